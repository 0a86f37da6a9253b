#!/usr/bin/env bash
# Installs and starts a Docker engine for the test suite, then builds the local test images.
#
# No image registry is reachable here, so every image is built from this host's files:
#   asynctorchx-test/busybox:latest  FROM scratch + the static busybox (about 2 MB)
#   asynctorchx-test/python:3.11     Debian's python3.11 and the shared libraries it needs, plus busybox
#   asynctorchx-test/torch:2.13      the python image plus torch==2.13.0 (CPU) from the local wheel
# Nothing here uses systemd. Safe to run again: a running daemon is kept and an image that already
# exists is not rebuilt (set ASYNCTORCHX_DOCKER_REBUILD=1 to rebuild them all).
#
# Environment:
#   ASYNCTORCHX_DOCKER_WAIT     seconds to wait for the daemon to answer (default 60)
#   ASYNCTORCHX_DOCKER_REBUILD  1 = rebuild the test images even if they exist
#   ASYNCTORCHX_DOCKER_NO_TORCH 1 = skip the torch image
set -euo pipefail

WAIT_SECONDS=${ASYNCTORCHX_DOCKER_WAIT:-60}
REBUILD=${ASYNCTORCHX_DOCKER_REBUILD:-0}
NO_TORCH=${ASYNCTORCHX_DOCKER_NO_TORCH:-0}
TORCH_VERSION=2.13.0
BUSYBOX_IMAGE=asynctorchx-test/busybox:latest
PYTHON_IMAGE=asynctorchx-test/python:3.11
TORCH_IMAGE=asynctorchx-test/torch:2.13
DOCKERD_LOG=/var/log/dockerd.log

log() { printf 'docker.sh: %s\n' "$*" >&2; }
die() { printf 'docker.sh: error: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "must run as root (installs packages and starts dockerd)"

# -- packages ------------------------------------------------------------------------------------
need_pkgs=()
command -v dockerd >/dev/null 2>&1 || need_pkgs+=(docker.io)
[[ -x /bin/busybox ]] || need_pkgs+=(busybox-static)
[[ -x /usr/bin/python3.11 && -f /usr/lib/python3.11/os.py ]] || need_pkgs+=(python3.11)
if ((${#need_pkgs[@]})); then
  log "installing ${need_pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null \
    || die "apt-get install ${need_pkgs[*]} failed"
fi
if ! /bin/busybox --list 2>/dev/null | grep -x nc >/dev/null; then
  die "/bin/busybox is not the full static busybox (install busybox-static)"
fi

# -- daemon --------------------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
  if pgrep -x dockerd >/dev/null 2>&1; then
    log "dockerd is running but does not answer yet; waiting"
  else
    log "starting dockerd (log: $DOCKERD_LOG)"
    # Pid files outlive their daemons, and the pid they name may belong to an unrelated process
    # by now. No dockerd runs, so docker.pid is stale (it would stop dockerd from starting); the
    # containerd one is stale unless it names a containerd (dockerd would take the stranger for
    # its containerd, fail to reach it, and in the end kill it).
    rm -f /var/run/docker.pid
    containerd_pidfile=/var/run/docker/containerd/containerd.pid
    if [[ -s $containerd_pidfile ]] &&
      [[ $(cat "/proc/$(<"$containerd_pidfile")/comm" 2>/dev/null) != containerd ]]; then
      rm -f "$containerd_pidfile"
    fi
    setsid nohup dockerd -H unix:///var/run/docker.sock >>"$DOCKERD_LOG" 2>&1 </dev/null &
  fi
  deadline=$((SECONDS + WAIT_SECONDS))
  until docker info >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      tail -n 20 "$DOCKERD_LOG" >&2 || true
      die "dockerd did not answer 'docker info' within ${WAIT_SECONDS}s (see $DOCKERD_LOG)"
    fi
    sleep 0.2
  done
fi
log "engine up: $(docker version --format 'server {{.Server.Version}}, API {{.Server.APIVersion}}')"

# -- images --------------------------------------------------------------------------------------
# Images carry the version of the recipe that built them; bump it when a recipe below changes, so
# that an image built by an older recipe is rebuilt.
RECIPE_LABEL=io.asynctorchx.test-image-recipe
RECIPE_VERSION=2
have_image() {
  [[ $REBUILD != 1 ]] &&
    [[ $(docker image inspect --format "{{index .Config.Labels \"$RECIPE_LABEL\"}}" "$1" 2>/dev/null) == "$RECIPE_VERSION" ]]
}

work=$(mktemp -d /tmp/asynctorchx-docker-build.XXXXXX)
trap 'rm -rf "$work"' EXIT

# copy_needed_libs ROOT FILE... : copies into ROOT every host shared library (and the loader) that
# one of FILE links against, unless ROOT already has it.
copy_needed_libs() {
  local root=$1 lib
  shift
  printf '%s\0' "$@" | xargs -0 -r ldd 2>/dev/null \
    | awk '/=> \// {print $3} /^\t\// {print $1}' | sort -u | while read -r lib; do
      [[ -e $lib && ! -e $root$lib ]] || continue
      mkdir -p "$root$(dirname "$lib")"
      cp -L "$lib" "$root$lib"
    done
}

# make_python_rootfs DIR : Debian's python3.11, its stdlib, the shared libraries they load, busybox.
make_python_rootfs() {
  local root=$1
  mkdir -p "$root"/{bin,usr/bin,usr/lib,etc,tmp,root,workspace}
  chmod 1777 "$root/tmp"
  cp /bin/busybox "$root/bin/busybox"
  # The busybox applets (sh, ls, nc, ...) as symlinks; `python` and `python3` point to python3.11.
  local applet
  for applet in $(/bin/busybox --list); do
    [[ $applet == busybox ]] || ln -sf busybox "$root/bin/$applet"
  done
  cp -a /usr/bin/python3.11 "$root/usr/bin/python3.11"
  ln -sf python3.11 "$root/usr/bin/python3"
  ln -sf python3.11 "$root/usr/bin/python"
  # With the compiled modules (__pycache__): the image runs with PYTHONDONTWRITEBYTECODE=1.
  tar -C / --exclude='test' --exclude='idlelib' --exclude='tkinter' --exclude='ensurepip' \
    -cf - usr/lib/python3.11 | tar -C "$root" -xf -
  copy_needed_libs "$root" /usr/bin/python3.11 /usr/lib/python3.11/lib-dynload/*.so
  # /lib64 and /lib are symlinks into /usr on Debian 12; keep them so the loader path resolves.
  [[ -L /lib64 ]] && ln -sfn "$(readlink /lib64)" "$root/lib64"
  [[ -L /lib ]] && ln -sfn "$(readlink /lib)" "$root/lib"
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' \
    >"$root/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
}

# import_rootfs DIR IMAGE : imports DIR as IMAGE with the environment a Python image has.
import_rootfs() {
  local root=$1 image=$2
  # On a rebuild, drop the old image first so that it does not linger untagged.
  docker rmi -f "$image" >/dev/null 2>&1 || true
  tar -C "$root" -cf - . | docker import \
    --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PYTHONDONTWRITEBYTECODE=1' \
    --change 'WORKDIR /workspace' \
    --change 'CMD ["/usr/bin/python3"]' \
    --change "LABEL $RECIPE_LABEL=$RECIPE_VERSION" \
    - "$image" >/dev/null
}

if have_image "$BUSYBOX_IMAGE"; then
  log "$BUSYBOX_IMAGE exists"
else
  log "building $BUSYBOX_IMAGE"
  start=$SECONDS
  mkdir -p "$work/busybox"
  cp /bin/busybox "$work/busybox/busybox"
  cat >"$work/busybox/Dockerfile" <<'EOF'
FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "sh", "-c", "/bin/busybox --install -s /bin && mkdir -m 1777 /tmp"]
ENV PATH=/bin
CMD ["/bin/sh"]
EOF
  echo "LABEL $RECIPE_LABEL=$RECIPE_VERSION" >>"$work/busybox/Dockerfile"
  if ! DOCKER_BUILDKIT=0 docker build -q --network none -t "$BUSYBOX_IMAGE" "$work/busybox" \
    >"$work/build.log" 2>&1; then
    cat "$work/build.log" >&2
    die "building $BUSYBOX_IMAGE failed"
  fi
  log "built $BUSYBOX_IMAGE in $((SECONDS - start))s"
fi

if have_image "$PYTHON_IMAGE"; then
  log "$PYTHON_IMAGE exists"
else
  log "building $PYTHON_IMAGE"
  start=$SECONDS
  make_python_rootfs "$work/python"
  import_rootfs "$work/python" "$PYTHON_IMAGE" || die "importing $PYTHON_IMAGE failed"
  if ! docker run --rm --network none "$PYTHON_IMAGE" python3 -c 'import ssl, json, socket, ctypes'; then
    docker rmi -f "$PYTHON_IMAGE" >/dev/null 2>&1 || true
    die "$PYTHON_IMAGE cannot run python3 (a shared library is missing?)"
  fi
  log "built $PYTHON_IMAGE in $((SECONDS - start))s"
fi

if [[ $NO_TORCH == 1 ]]; then
  log "skipping $TORCH_IMAGE (ASYNCTORCHX_DOCKER_NO_TORCH=1)"
elif have_image "$TORCH_IMAGE"; then
  log "$TORCH_IMAGE exists"
else
  log "building $TORCH_IMAGE"
  start=$SECONDS
  root="$work/torch"
  make_python_rootfs "$root"
  site="$root/usr/lib/python3/dist-packages"
  mkdir -p "$site"
  # torch and its dependencies for cp311 from the local wheel cache; numpy is optional for torch
  # but without it torch warns on import, so it is added too.
  if ! python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --no-compile --no-warn-script-location --target "$site" --python-version 3.11 \
    --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform any \
    "torch==$TORCH_VERSION" numpy >"$work/pip.log" 2>&1; then
    cat "$work/pip.log" >&2
    die "pip install --target torch==$TORCH_VERSION failed"
  fi
  # C++ headers and test binaries (~200 MB) are not needed to run; torch_shm_manager is.
  rm -rf "$site/torch/include" "$site/torch/test"
  find "$site/torch/bin" -type f ! -name torch_shm_manager -delete 2>/dev/null || true
  # Byte-compile the modules a distributed job imports (by importing them with this host's Python
  # 3.11, whose .pyc format the image's shares): the image runs with PYTHONDONTWRITEBYTECODE=1, and
  # compiling torch's modules in every process would cost seconds. Compiling all 5000 would take
  # much longer than these ~900.
  if ! (cd / && env -u PYTHONDONTWRITEBYTECODE PYTHONPATH="$site" python3 -S -c \
    'import numpy, torch, torch.distributed.run, torch.optim
from torch.nn.parallel import DistributedDataParallel') >"$work/warm.log" 2>&1; then
    cat "$work/warm.log" >&2
    die "importing the installed torch==$TORCH_VERSION failed"
  fi
  # torch's libraries load a few more system libraries (libstdc++, libgomp's friends...).
  mapfile -d '' sos < <(find "$site" -name '*.so*' -type f -print0)
  copy_needed_libs "$root" "${sos[@]}"
  # torchrun as a command, like a pip-installed torch provides it.
  mkdir -p "$root/usr/local/bin"
  cat >"$root/usr/local/bin/torchrun" <<'EOF'
#!/usr/bin/python3
import sys
from torch.distributed.run import main
sys.exit(main())
EOF
  chmod 755 "$root/usr/local/bin/torchrun"
  rm -rf "${site:?}/bin"
  import_rootfs "$root" "$TORCH_IMAGE" || die "importing $TORCH_IMAGE failed"
  if ! docker run --rm --network none "$TORCH_IMAGE" \
    python3 -c 'import torch.distributed as d; assert d.is_gloo_available()'; then
    docker rmi -f "$TORCH_IMAGE" >/dev/null 2>&1 || true
    die "$TORCH_IMAGE cannot import torch with gloo"
  fi
  log "built $TORCH_IMAGE in $((SECONDS - start))s"
fi

log "ready"
