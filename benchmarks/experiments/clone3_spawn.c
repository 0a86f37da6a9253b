/* An experiment (benchmarks/spawn_into_cgroup.py), not part of the package: starting a program
 * straight into its cgroup with clone3(CLONE_INTO_CGROUP), the way posix_spawn starts one
 * (CLONE_VM | CLONE_VFORK: the child runs on a stack of its own in the caller's memory until it
 * has exec'd), so that no move into the cgroup follows the spawn. x86_64 only: the child must
 * start on its new stack, which only a few instructions of assembly can do. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/sched.h>

#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif

struct child {
    const char *path;
    char *const *argv;
    char *const *envp;
    int fds[3];
    const char *cwd;
    volatile int err;
};

__attribute__((visibility("hidden"))) long atx_clone3(void *args, size_t size,
                                                     int (*fn)(void *), void *arg);
__asm__(".text\n"
        ".globl atx_clone3\n"
        ".hidden atx_clone3\n"
        ".type atx_clone3, @function\n"
        "atx_clone3:\n"
        "    mov %rdx, %r8\n"
        "    mov %rcx, %r9\n"
        "    mov $435, %eax\n"
        "    syscall\n"
        "    test %rax, %rax\n"
        "    jz 1f\n"
        "    ret\n"
        "1:\n"
        "    xor %ebp, %ebp\n"
        "    mov %r9, %rdi\n"
        "    call *%r8\n"
        "    mov %eax, %edi\n"
        "    mov $231, %eax\n"
        "    syscall\n"
        "    hlt\n"
        ".size atx_clone3, .-atx_clone3\n");

/* The child, sharing the caller's memory: signal handlers of the caller must not run here, so
 * every handled signal is reset before the (blocked) signals are unblocked; then exec. */
static int child_main(void *p) {
    struct child *c = p;
    struct sigaction sa;
    sigset_t none;
    memset(&sa, 0, sizeof sa);
    for (int sig = 1; sig < _NSIG; sig++) {
        struct sigaction old;
        if (sigaction(sig, NULL, &old) != 0) continue;
        if (old.sa_handler == SIG_DFL) continue;
        if (old.sa_handler == SIG_IGN && sig != SIGPIPE && sig != SIGXFSZ) continue;
        sa.sa_handler = SIG_DFL;
        sigaction(sig, &sa, NULL);
    }
    if (setsid() < 0) goto fail;
    for (int i = 0; i < 3; i++)
        if (dup2(c->fds[i], i) < 0) goto fail;
    if (c->cwd && chdir(c->cwd) < 0) goto fail;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    execve(c->path, c->argv, c->envp);
fail:
    c->err = errno ? errno : EINVAL;
    return 127;
}

/* Returns the pid (>0) with *pidfd_out set (the child has exec'd), or -errno. */
long atx_spawn(const char *path, char *const *argv, char *const *envp, int fd0, int fd1, int fd2,
               const char *cwd, int cgroup_fd, int *pidfd_out) {
    struct child c = {path, argv, envp, {fd0, fd1, fd2}, cwd, 0};
    size_t stack_size = 64 * 1024;
    void *stack = mmap(NULL, stack_size, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED) return -errno;
    uint64_t args[11];
    memset(args, 0, sizeof args);
    int pidfd = -1;
    args[0] = CLONE_VM | CLONE_VFORK | CLONE_PIDFD | (cgroup_fd >= 0 ? CLONE_INTO_CGROUP : 0);
    args[1] = (uintptr_t)&pidfd;  /* pidfd */
    args[2] = 0;                  /* child_tid */
    args[3] = 0;                  /* parent_tid */
    args[4] = SIGCHLD;            /* exit_signal */
    args[5] = (uintptr_t)stack;   /* stack */
    args[6] = stack_size;         /* stack_size */
    args[7] = 0;                  /* tls */
    args[8] = 0;                  /* set_tid */
    args[9] = 0;                  /* set_tid_size */
    args[10] = cgroup_fd >= 0 ? (uint64_t)cgroup_fd : 0; /* cgroup */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int saved = errno;
    long pid = atx_clone3(args, sizeof args, child_main, &c);
    errno = saved;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    munmap(stack, stack_size);
    if (pid < 0) return pid;
    if (c.err) {
        siginfo_t info;
        syscall(SYS_waitid, P_PIDFD, pidfd, &info, WEXITED, NULL);
        close(pidfd);
        return -c.err;
    }
    *pidfd_out = pidfd;
    return pid;
}
