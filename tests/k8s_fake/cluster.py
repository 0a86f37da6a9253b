"""The fake control plane behind the fake API server: a Job controller, a kubelet, a garbage collector.

It is small and deterministic, and does what the backend relies on a real cluster to do:

- **Job controller** (Indexed Jobs only): creates one pod per pending index (``{job}-{index}-xxxxx``,
  hostname ``{job}-{index}``, the completion-index label/annotation, owner reference with
  ``blockOwnerDeletion``, a ``JOB_COMPLETION_INDEX`` env var unless declared); counts succeeded and
  failed pods; applies ``podFailurePolicy`` (``Ignore`` on ``DisruptionTarget``, ``FailJob``,
  ``FailIndex``, ``Count``, on pod conditions or exit codes), ``backoffLimit``,
  ``backoffLimitPerIndex``/``maxFailedIndexes`` (recording ``job-index-failure-count`` and
  ``job-index-ignored-failure-count`` on replacement pods), ``podReplacementPolicy: Failed`` (a
  replacement only once the old pod is terminal) and ``suspend`` (and resuming, as Kueue's admission
  does: the ``Suspended`` condition turns False); writes the status fields and
  conditions (``FailureTarget``/``Failed``, ``SuccessCriteriaMet``/``Complete``, ``Suspended``) in the
  shapes recorded from real clusters (tests/fixtures/kubernetes);
- **kubelet**: schedules each pod on ``fake-node``, starts it, expands ``$(VAR)`` references in env,
  command and args like the kubelet (env from values and downward-API field refs), runs a scripted
  outcome (``PodScript``: log lines, exit code, termination message, or hold until released), and
  stops containers of deleted pods (exit 143);
- **garbage collector**: deletes dependents of deleted owners (background) and completes foreground
  deletions once the blocking dependents are gone;
- **pod logs**: each line is stored with a nanosecond timestamp, for the server's log endpoint.

What it cannot prove: scheduling and resources, image pulls, DNS, admission, RBAC and quota,
real timings and the garbage collector's real ordering.
"""

from __future__ import annotations

import asyncio
import copy
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from k8s_fake.store import ApiError, Event, Store, now_rfc3339

COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
INDEX_FAILURES = "batch.kubernetes.io/job-index-failure-count"
INDEX_IGNORED = "batch.kubernetes.io/job-index-ignored-failure-count"
TRACKING_FINALIZER = "batch.kubernetes.io/job-tracking"


def format_ts(ns: int) -> str:
    """A kubelet log timestamp: RFC 3339 with nine fractional digits, UTC."""
    seconds, frac = divmod(ns, 1_000_000_000)
    base = datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{base}.{frac:09d}Z"


@dataclass(frozen=True)
class PodContext:
    """What a script knows about the pod it runs in (after the kubelet's ``$(VAR)`` expansion)."""

    namespace: str
    pod_name: str
    job_name: str
    labels: dict[str, str]
    index: int
    #: how many pods of this index failed before (failures + ignored disruptions)
    index_attempt: int
    env: dict[str, str]
    argv: list[str]

    @property
    def role(self) -> str:
        return self.labels.get("asynctorchx.dev/role-name", "")

    @property
    def app(self) -> str:
        return self.labels.get("asynctorchx.dev/app-id", "")

    @property
    def app_attempt(self) -> int:
        return int(self.labels.get("asynctorchx.dev/app-attempt", "0"))

    @property
    def role_attempt(self) -> int:
        return int(self.labels.get("asynctorchx.dev/role-attempt", "0"))


@dataclass
class PodScript:
    """A scripted container run.

    Args:
        lines: log lines (str, or bytes for raw output), written one by one with their own
            timestamps (a line without ``\\n`` is a partial last line).
        exit_code: the container's exit code.
        line_interval: seconds between lines.
        start_delay: seconds the pod stays Pending (ContainerCreating) before it runs.
        start: when set, the pod also stays Pending until this event is set (a test's go signal,
            where ``start_delay`` would only make it likely).
        gates: line ``i`` is written only once ``gates[i]`` is set (the pod keeps running).
        hold: when set, the container keeps running after its lines until this event is set
            (or the pod is deleted).
        message: the termination message (what the container wrote to /dev/termination-log).
        burst: lines are stamped in groups of this many sharing one timestamp (lines written in
            one burst, as a kubelet can stamp them alike).
        stamp_offsets: line ``i`` is stamped this many nanoseconds off the time it is written
            (negative: before the lines stored ahead of it, as containerd stamps a stdout or
            stderr line when it reads it, before the log's shared writer takes it).
    """

    lines: list[str | bytes] = field(default_factory=list)
    exit_code: int = 0
    line_interval: float = 0.001
    start_delay: float = 0.002
    start: asyncio.Event | None = None
    gates: dict[int, asyncio.Event] = field(default_factory=dict)
    hold: asyncio.Event | None = None
    message: str = ""
    burst: int = 1
    stamp_offsets: dict[int, int] = field(default_factory=dict)


def default_script(ctx: PodContext) -> PodScript:
    """Echoes the container's expanded argv and exits 0."""
    return PodScript(lines=[" ".join(ctx.argv) + "\n"])


@dataclass
class PodLog:
    lines: list[tuple[int, bytes]] = field(default_factory=list)
    closed: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    clock: int = 0  # when the last line was written (its stamp, but for its offset)

    def append(self, text: str | bytes, same_stamp: bool = False, offset: int = 0) -> None:
        ts = time.time_ns()
        if self.lines and (same_stamp or ts <= self.clock):
            ts = self.clock + (0 if same_stamp else 1)
        self.clock = ts
        self.lines.append((ts + offset, text.encode() if isinstance(text, str) else text))
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


_VAR_REF = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Expands ``$(VAR)`` like the kubelet: unknown references stay, ``$$`` is a literal ``$``."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR_REF.sub(sub, value)


_FIELD = re.compile(r"metadata\.(annotations|labels)\['([^']+)'\]")


def resolve_env(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    meta = pod["metadata"]
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item:
            env[name] = expand(str(item["value"]), env)
            continue
        ref = ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath", "")
        m = _FIELD.fullmatch(ref)
        if m:
            env[name] = str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
        elif ref == "metadata.name":
            env[name] = meta["name"]
        elif ref == "metadata.namespace":
            env[name] = meta["namespace"]
        elif ref == "spec.nodeName":
            env[name] = str(pod["spec"].get("nodeName", ""))
        else:
            env[name] = ""
    return env


class FakeCluster:
    """The control plane: reacts to store events with the Job controller, kubelet and GC.

    Args:
        store: the API server's storage.
        script: decides what each pod does (``default_script`` when None).
        schedule_delay: seconds before a new pod is bound to the node.
    """

    def __init__(
        self,
        store: Store,
        script: Callable[[PodContext], PodScript] | None = None,
        schedule_delay: float = 0.001,
    ) -> None:
        self.store = store
        self.script = script or default_script
        self.schedule_delay = schedule_delay
        self.logs: dict[tuple[str, str], PodLog] = {}
        self.pod_contexts: list[PodContext] = []
        self._dirty_jobs: set[tuple[str, str]] = set()
        self._gc_dirty = False
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pod_tasks: dict[str, asyncio.Task[Any]] = {}
        self._stops: dict[tuple[str, str], asyncio.Event] = {}
        self._stop_reasons: dict[tuple[str, str], str] = {}
        self._counted: dict[str, set[str]] = {}
        self._stop: asyncio.Event | None = None
        self._unsubscribe = store.subscribe(self._on_event)
        self.errors: list[BaseException] = []

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._spawn(self._loop())

    async def aclose(self) -> None:
        self._unsubscribe()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for log in self.logs.values():
            log.close()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(task.exception())  # type: ignore[arg-type]

    # -- events ----------------------------------------------------------------------------------

    def _on_event(self, ev: Event) -> None:
        meta = ev.obj["metadata"]
        if ev.resource == "jobs":
            self._dirty_jobs.add((ev.namespace, meta["name"]))
        elif ev.resource == "pods":
            for ref in meta.get("ownerReferences") or []:
                if ref.get("kind") == "Job":
                    self._dirty_jobs.add((ev.namespace, ref["name"]))
            if ev.type == "ADDED":
                uid = meta["uid"]
                self._pod_tasks[uid] = self._spawn(self._kubelet(ev.namespace, meta["name"]))
            elif ev.type == "MODIFIED" and meta.get("deletionTimestamp"):
                key = (ev.namespace, meta["name"])
                if key in self._stops:
                    self._stop_reasons.setdefault(key, "deleted")
                    self._stops[key].set()
                else:
                    self._spawn(self._finish_pod_deletion(ev.namespace, meta["name"]))
        self._gc_dirty = True
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)
            jobs, self._dirty_jobs = self._dirty_jobs, set()
            for ns, name in sorted(jobs):
                try:
                    self._sync_job(ns, name)
                except ApiError:
                    pass
            if self._gc_dirty:
                self._gc_dirty = False
                self._collect_garbage()

    # -- garbage collector -----------------------------------------------------------------------

    def _collect_garbage(self) -> None:
        s = self.store
        live = s.uids()
        for (resource, ns, name), obj in list(s.objects.items()):
            if (resource, ns, name) not in s.objects:
                continue
            meta = obj["metadata"]
            refs = meta.get("ownerReferences") or []
            if (
                refs
                and not any(r.get("uid") in live for r in refs)
                and not meta.get("deletionTimestamp")
            ):
                s.delete(resource, ns, name, "Background")
                continue
            if "foregroundDeletion" in (meta.get("finalizers") or []):
                deps = s.dependents(meta["uid"], ns)
                for dres, dep in deps:
                    if not dep["metadata"].get("deletionTimestamp"):
                        s.delete(dres, ns, dep["metadata"]["name"], "Foreground")
                blocking = [
                    d
                    for _, d in deps
                    if any(
                        r.get("uid") == meta["uid"] and r.get("blockOwnerDeletion")
                        for r in d["metadata"].get("ownerReferences") or []
                    )
                ]
                if not blocking and (resource, ns, name) in s.objects:
                    s.finalize_delete(resource, ns, name)

    # -- job controller --------------------------------------------------------------------------

    def _sync_job(self, ns: str, name: str) -> None:
        s = self.store
        job = s.peek("jobs", ns, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            return
        spec, status = job["spec"], copy.deepcopy(job.get("status") or {})
        uid = job["metadata"]["uid"]
        pods = s.owned("pods", ns, uid)
        completions = int(spec.get("completions", 1))
        per_index = spec.get("backoffLimitPerIndex")
        counted = self._counted.setdefault(uid, set())
        conds = {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}
        finished = "Complete" in conds or "Failed" in conds
        now = now_rfc3339()

        def active(p: dict[str, Any]) -> bool:
            return p["status"].get("phase") not in ("Succeeded", "Failed")

        if finished:
            for p in pods:
                if active(p) and not p["metadata"].get("deletionTimestamp"):
                    s.delete("pods", ns, p["metadata"]["name"], "Background")
            return
        if spec.get("suspend"):
            for p in pods:
                if active(p) and not p["metadata"].get("deletionTimestamp"):
                    s.delete("pods", ns, p["metadata"]["name"], "Background")
            if "Suspended" not in conds:
                status.setdefault("conditions", []).append(
                    _condition("Suspended", "JobSuspended", "Job suspended", now)
                )
            status["active"] = sum(1 for p in pods if active(p))
            self._write_status(job, status)
            return
        if "Suspended" in conds:  # resumed (e.g. admitted by Kueue): the condition turns False
            conds["Suspended"].update(
                status="False", reason="JobResumed", message="Job resumed", lastTransitionTime=now
            )
        status.setdefault("startTime", now)
        succeeded = _index_set(status.get("completedIndexes"))
        failed_indexes = _index_set(status.get("failedIndexes"))
        index_failures: dict[int, int] = {}
        index_ignored: dict[int, int] = {}
        for p in pods:
            idx = _pod_index(p)
            ann = p["metadata"].get("annotations") or {}
            index_failures[idx] = max(index_failures.get(idx, 0), int(ann.get(INDEX_FAILURES, "0")))
            index_ignored[idx] = max(index_ignored.get(idx, 0), int(ann.get(INDEX_IGNORED, "0")))
        fail_reason: tuple[str, str] | None = None
        for p in sorted(pods, key=lambda p: int(p["metadata"]["resourceVersion"])):
            puid, phase, idx = p["metadata"]["uid"], p["status"].get("phase"), _pod_index(p)
            if puid in counted or phase not in ("Succeeded", "Failed"):
                continue
            counted.add(puid)
            if phase == "Succeeded":
                succeeded.add(idx)
                status["succeeded"] = int(status.get("succeeded", 0)) + 1
                continue
            action = _failure_action(spec.get("podFailurePolicy"), p)
            if action == "Ignore":
                index_ignored[idx] = index_ignored.get(idx, 0) + 1
                continue
            status["failed"] = int(status.get("failed", 0)) + 1
            if action == "FailJob":
                fail_reason = (
                    "PodFailurePolicy",
                    f"Pod {ns}/{p['metadata']['name']} matched a FailJob rule",
                )
            elif action == "FailIndex":
                failed_indexes.add(idx)
            elif per_index is not None:
                index_failures[idx] = index_failures.get(idx, 0) + 1
                if index_failures[idx] > int(per_index):
                    failed_indexes.add(idx)
            elif int(status["failed"]) > int(spec.get("backoffLimit", 6)):
                fail_reason = (
                    "BackoffLimitExceeded",
                    "Job has reached the specified backoff limit",
                )
        if per_index is not None and fail_reason is None:
            max_failed = spec.get("maxFailedIndexes")
            if max_failed is not None and len(failed_indexes) > int(max_failed):
                fail_reason = (
                    "MaxFailedIndexesExceeded",
                    "Job has exceeded the specified maximal number of failed indexes",
                )
        if per_index is not None:
            status["failedIndexes"] = _index_str(failed_indexes)
        status["completedIndexes"] = _index_str(succeeded)
        live_pods = [p for p in pods if active(p)]
        if fail_reason is not None or "FailureTarget" in conds:
            if "FailureTarget" not in conds and fail_reason is not None:
                status.setdefault("conditions", []).append(
                    _condition("FailureTarget", *fail_reason, now)
                )
                conds["FailureTarget"] = status["conditions"][-1]
            for p in live_pods:
                if not p["metadata"].get("deletionTimestamp"):
                    s.delete("pods", ns, p["metadata"]["name"], "Background")
            if not live_pods:
                target = conds["FailureTarget"]
                status["conditions"].append(
                    _condition("Failed", target["reason"], target["message"], now)
                )
        elif len(succeeded) >= completions:
            status.setdefault("conditions", []).extend(
                [
                    _condition(
                        "SuccessCriteriaMet",
                        "CompletionsReached",
                        "Reached expected number of succeeded pods",
                        now,
                    ),
                    _condition(
                        "Complete",
                        "CompletionsReached",
                        "Reached expected number of succeeded pods",
                        now,
                    ),
                ]
            )
            status["completionTime"] = now
        else:
            busy = {_pod_index(p) for p in live_pods}
            for idx in range(completions):
                if idx in succeeded or idx in failed_indexes or idx in busy:
                    continue
                self._create_pod(
                    job,
                    idx,
                    index_failures.get(idx, 0),
                    index_ignored.get(idx, 0),
                    per_index is not None,
                )
                busy.add(idx)
            live_pods = [p for p in s.owned("pods", ns, uid) if active(p)]
        status["active"] = len(live_pods)
        status["ready"] = sum(
            1
            for p in live_pods
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions") or []
            )
        )
        status["terminating"] = sum(1 for p in live_pods if p["metadata"].get("deletionTimestamp"))
        status["uncountedTerminatedPods"] = {}
        self._write_status(job, status)

    def _write_status(self, job: dict[str, Any], status: dict[str, Any]) -> None:
        if status != job.get("status"):
            self.store.replace("jobs", {**job, "status": status})

    def _create_pod(
        self, job: dict[str, Any], idx: int, failures: int, ignored: int, per_index: bool
    ) -> None:
        jmeta, template = job["metadata"], copy.deepcopy(job["spec"]["template"])
        meta = template.get("metadata") or {}
        labels = {**(meta.get("labels") or {}), COMPLETION_INDEX: str(idx)}
        annotations = {**(meta.get("annotations") or {}), COMPLETION_INDEX: str(idx)}
        if per_index:
            annotations[INDEX_FAILURES] = str(failures)
        if ignored:
            annotations[INDEX_IGNORED] = str(ignored)
        spec = template["spec"]
        spec["hostname"] = f"{jmeta['name']}-{idx}"
        for c in spec.get("containers") or []:
            env = c.setdefault("env", [])
            if not any(e["name"] == "JOB_COMPLETION_INDEX" for e in env):
                env.append(
                    {
                        "name": "JOB_COMPLETION_INDEX",
                        "valueFrom": {
                            "fieldRef": {"fieldPath": f"metadata.labels['{COMPLETION_INDEX}']"}
                        },
                    }
                )
        pod = {
            "metadata": {
                "generateName": f"{jmeta['name']}-{idx}-",
                "labels": labels,
                "annotations": annotations,
                "finalizers": [TRACKING_FINALIZER],
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": jmeta["name"],
                        "uid": jmeta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": spec,
        }
        self.store.create("pods", jmeta["namespace"], pod)

    # -- kubelet ---------------------------------------------------------------------------------

    def _pod(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.store.find("pods", ns, name)

    def _update_pod(
        self, ns: str, name: str, fn: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any] | None:
        pod = self._pod(ns, name)
        if pod is None:
            return None
        fn(pod)
        return self.store.replace("pods", pod)

    async def _kubelet(self, ns: str, name: str) -> None:
        await asyncio.sleep(self.schedule_delay)
        pod = self._pod(ns, name)
        if pod is None:
            return
        if pod["metadata"].get("deletionTimestamp"):
            await self._finish_pod_deletion(ns, name)
            return
        container = pod["spec"]["containers"][0]
        env = resolve_env(pod, container)
        argv = [
            expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])
        ]
        meta = pod["metadata"]
        ann = meta.get("annotations") or {}
        ctx = PodContext(
            namespace=ns,
            pod_name=name,
            job_name=next(
                (r["name"] for r in meta.get("ownerReferences") or [] if r.get("kind") == "Job"), ""
            ),
            labels=dict(meta.get("labels") or {}),
            index=_pod_index(pod),
            index_attempt=int(ann.get(INDEX_FAILURES, "0")) + int(ann.get(INDEX_IGNORED, "0")),
            env=env,
            argv=argv,
        )
        self.pod_contexts.append(ctx)
        script = self.script(ctx)
        now = now_rfc3339()
        cname, image = container["name"], container.get("image", "")
        serial = len(self.pod_contexts)

        def scheduled(p: dict[str, Any]) -> None:
            p["spec"]["nodeName"] = "fake-node"
            p["status"] = {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "Initialized",
                        "status": "True",
                        "lastProbeTime": None,
                        "lastTransitionTime": now,
                    },
                    {
                        "type": "Ready",
                        "status": "False",
                        "lastProbeTime": None,
                        "lastTransitionTime": now,
                        "reason": "ContainersNotReady",
                        "message": f"containers with unready status: [{cname}]",
                    },
                    {
                        "type": "ContainersReady",
                        "status": "False",
                        "lastProbeTime": None,
                        "lastTransitionTime": now,
                        "reason": "ContainersNotReady",
                        "message": f"containers with unready status: [{cname}]",
                    },
                    {
                        "type": "PodScheduled",
                        "status": "True",
                        "lastProbeTime": None,
                        "lastTransitionTime": now,
                    },
                ],
                "containerStatuses": [
                    {
                        "image": image,
                        "imageID": "",
                        "lastState": {},
                        "name": cname,
                        "ready": False,
                        "restartCount": 0,
                        "started": False,
                        "state": {"waiting": {"reason": "ContainerCreating"}},
                    }
                ],
                "hostIP": "10.0.0.1",
                "podIP": f"10.1.{serial // 250}.{serial % 250 + 1}",
                "qosClass": p["status"].get("qosClass", "BestEffort"),
                "startTime": now,
            }

        if self._update_pod(ns, name, scheduled) is None:
            return
        log = self.logs.setdefault((ns, name), PodLog())
        stop = asyncio.Event()
        self._stops[(ns, name)] = stop
        exit_code, message = 143, ""
        try:
            if await _wait_or(stop, script.start_delay):
                return
            if script.start is not None and not await _first(script.start, stop):
                return
            started = now_rfc3339()

            def running(p: dict[str, Any]) -> None:
                cs = p["status"]["containerStatuses"][0]
                cs.update(
                    {
                        "ready": True,
                        "started": True,
                        "state": {"running": {"startedAt": started}},
                        "containerID": f"containerd://{p['metadata']['uid'].replace('-', '')}",
                        "imageID": f"{image}@sha256:{'0' * 64}",
                    }
                )
                p["status"]["phase"] = "Running"
                for c in p["status"]["conditions"]:
                    if c["type"] in ("Ready", "ContainersReady"):
                        c.update({"status": "True", "lastTransitionTime": started})
                        c.pop("reason", None)
                        c.pop("message", None)

            if self._update_pod(ns, name, running) is None:
                return
            for i, line in enumerate(script.lines):
                gate = script.gates.get(i)
                if gate is not None and not await _first(gate, stop):
                    return
                log.append(
                    line, same_stamp=i % script.burst != 0, offset=script.stamp_offsets.get(i, 0)
                )
                if await _wait_or(stop, script.line_interval):
                    return
            if script.hold is not None and not await _first(script.hold, stop):
                return
            exit_code, message = script.exit_code, script.message
        finally:
            self._stops.pop((ns, name), None)
            disrupted = self._stop_reasons.pop((ns, name), None) == "disrupted"
            if disrupted:
                exit_code, message = 137, ""
            log.close()
            self._terminate(
                ns, name, started_at=now, exit_code=exit_code, message=message, disrupted=disrupted
            )
            if (p := self._pod(ns, name)) is not None and p["metadata"].get("deletionTimestamp"):
                self.store.finalize_delete("pods", ns, name)

    def _terminate(
        self,
        ns: str,
        name: str,
        *,
        started_at: str,
        exit_code: int,
        message: str,
        disrupted: bool = False,
    ) -> None:
        finished = now_rfc3339()

        def terminated(p: dict[str, Any]) -> None:
            if p["status"].get("phase") in ("Succeeded", "Failed"):
                return
            statuses = p["status"].setdefault("containerStatuses", [{}])
            cs = statuses[0]
            running = (cs.get("state") or {}).get("running") or {}
            term: dict[str, Any] = {
                "containerID": cs.get(
                    "containerID", f"containerd://{p['metadata']['uid'].replace('-', '')}"
                ),
                "exitCode": exit_code,
                "finishedAt": finished,
                "reason": "Completed" if exit_code == 0 else "Error",
                "startedAt": running.get("startedAt", started_at),
            }
            if message:
                term["message"] = message
            cs.update({"ready": False, "started": False, "state": {"terminated": term}})
            p["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
            for c in p["status"].get("conditions") or []:
                if c["type"] in ("Ready", "ContainersReady"):
                    c.update(
                        {
                            "status": "False",
                            "lastTransitionTime": finished,
                            "reason": "PodCompleted",
                        }
                    )
                    c.pop("message", None)
            if disrupted:
                p["status"].setdefault("conditions", []).append(
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "lastProbeTime": None,
                        "lastTransitionTime": finished,
                        "reason": "PreemptionByScheduler",
                        "message": "fake-scheduler: preempting to accommodate a higher priority pod",
                    }
                )

        self._update_pod(ns, name, terminated)

    async def _finish_pod_deletion(self, ns: str, name: str) -> None:
        await asyncio.sleep(0.001)
        pod = self._pod(ns, name)
        if pod is None:
            return
        stop = self._stops.get((ns, name))
        if stop is not None:
            stop.set()
            return
        if pod["status"].get("phase") not in ("Succeeded", "Failed"):
            self._terminate(ns, name, started_at=now_rfc3339(), exit_code=143, message="")
        log = self.logs.get((ns, name))
        if log is not None:
            log.close()
        self.store.finalize_delete("pods", ns, name)

    # -- test hooks ------------------------------------------------------------------------------

    def disrupt(self, ns: str, name: str) -> None:
        """Preempts a running pod: it fails (exit 137) with a ``DisruptionTarget`` condition."""
        stop = self._stops.get((ns, name))
        if stop is None:
            raise ValueError(f"pod {ns}/{name} is not running")
        self._stop_reasons[(ns, name)] = "disrupted"
        stop.set()


async def _first(wanted: asyncio.Event, stop: asyncio.Event) -> bool:
    """Waits until ``wanted`` or ``stop`` is set; True when ``wanted`` was (and ``stop`` was not)."""
    waits = [asyncio.ensure_future(wanted.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    return not stop.is_set()


async def _wait_or(event: asyncio.Event, delay: float) -> bool:
    """Sleeps ``delay`` seconds; returns True at once if ``event`` is set meanwhile."""
    if event.is_set():
        return True
    try:
        await asyncio.wait_for(event.wait(), delay)
    except asyncio.TimeoutError:
        return False
    return True


def _condition(type_: str, reason: str, message: str, now: str) -> dict[str, Any]:
    return {
        "lastProbeTime": now,
        "lastTransitionTime": now,
        "message": message,
        "reason": reason,
        "status": "True",
        "type": type_,
    }


def _pod_index(pod: dict[str, Any]) -> int:
    meta = pod["metadata"]
    return int(
        (meta.get("annotations") or {}).get(
            COMPLETION_INDEX, (meta.get("labels") or {}).get(COMPLETION_INDEX, "-1")
        )
    )


def _failure_action(policy: dict[str, Any] | None, pod: dict[str, Any]) -> str:
    for rule in (policy or {}).get("rules") or []:
        for pc in rule.get("onPodConditions") or []:
            if any(
                c.get("type") == pc.get("type") and c.get("status") == pc.get("status", "True")
                for c in pod["status"].get("conditions") or []
            ):
                return str(rule["action"])
        codes = rule.get("onExitCodes")
        if codes:
            term = ((pod["status"].get("containerStatuses") or [{}])[0].get("state") or {}).get(
                "terminated"
            ) or {}
            code = term.get("exitCode")
            if code is not None and code != 0:
                inside = code in codes.get("values", [])
                if inside == (codes.get("operator") == "In"):
                    return str(rule["action"])
    return "Count"


def _index_set(text: str | None) -> set[int]:
    out: set[int] = set()
    for part in (text or "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _index_str(indexes: set[int]) -> str:
    """The Job status' compressed index list: ``1,3-5,7`` (two consecutive numbers stay ``1,2``)."""
    out: list[str] = []
    ordered = sorted(indexes)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j == i:
            out.append(str(ordered[i]))
        elif j == i + 1:
            out.extend([str(ordered[i]), str(ordered[j])])
        else:
            out.append(f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)
