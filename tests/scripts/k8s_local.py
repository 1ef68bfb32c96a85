"""Run rendered Kubernetes pods as local processes: a manifest-to-local translation for tests.

For every pod a workload would create (Indexed Job: one per completion index; NonIndexed Job:
``parallelism`` pods; StatefulSet: one per ordinal) it builds exactly the process Kubernetes would start: the container's
command + args, and the environment the manifest gives that pod plus what Kubernetes injects
(downward-API ``fieldRef`` values, ``secretKeyRef`` values of the rendered Secrets,
JOB_COMPLETION_INDEX, HOSTNAME; a container runtime's PATH and
HOME). The translation, and nothing else, stands in for the cluster:

* service DNS names (``*.NAMESPACE.svc``) become ``127.0.0.1``; ``status.podIP`` is 127.0.0.1;
* every pod shares 127.0.0.1, so ports are remapped to free local ports: a port a Service
  exposes keeps one mapping for the whole job (its peers address it), any other container port
  (metrics) gets one per pod;
* a configMap volume becomes a directory holding the ConfigMap's files; an emptyDir a fresh
  directory; a persistentVolumeClaim one directory per claim shared by every pod (ReadWriteMany);
  the mount path is rewritten to it in args and env;
* ``command[0]`` is looked up on PATH (the test's virtualenv bin first), cwd = the repository
  (the image's WORKDIR holds it).

Anything else in a manifest (other volume types, refs to objects not rendered...) raises: the test would not be
running what the manifest says.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


@dataclass
class LocalPod:
    """One pod, as a process to start."""

    name: str
    kind: str
    """Kind of the workload that owns it (Job / StatefulSet)."""
    argv: list[str]
    env: dict[str, str]
    cwd: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _field(path: str, pod: dict[str, Any]) -> str:
    m = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", path)
    if m:
        return str(pod["metadata"][m.group(1)][m.group(2)])
    values = {
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"]["namespace"],
        "status.podIP": "127.0.0.1",
        "spec.nodeName": "localhost",
    }
    if path not in values:
        raise ValueError(f"fieldRef {path!r} is not translated")
    return values[path]


def _secret_data(obj: dict[str, Any]) -> dict[str, str]:
    """A Secret's values (``data`` is base64, ``stringData`` plain, as the API server merges)."""
    data = {k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()}
    return {**data, **obj.get("stringData", {})}


def translate(objs: list[dict[str, Any]], workdir: Path, cwd: Path) -> list[LocalPod]:
    """Every pod of the rendered objects as a :class:`LocalPod` (workloads in manifest order)."""
    configmaps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    secrets = {o["metadata"]["name"]: _secret_data(o) for o in objs if o["kind"] == "Secret"}
    ns = objs[0]["metadata"]["namespace"]
    dns = re.compile(r"[A-Za-z0-9{}\-.]+\." + re.escape(ns) + r"\.svc(\.cluster\.local)?")
    service_ports = {p["port"] for o in objs if o["kind"] == "Service" for p in o["spec"]["ports"]}
    shared = {p: _free_port() for p in sorted(service_ports)}
    pods: list[LocalPod] = []
    for obj in objs:
        indexed = obj["kind"] == "Job" and obj["spec"].get("completionMode") == "Indexed"
        if indexed:
            count = obj["spec"]["completions"]
        elif obj["kind"] == "Job":  # NonIndexed (an elastic job): parallelism pods, no index
            count = obj["spec"]["parallelism"]
        elif obj["kind"] == "StatefulSet":
            count = obj["spec"]["replicas"]
        else:
            continue
        template = obj["spec"]["template"]
        for i in range(count):
            wname = obj["metadata"]["name"]
            annotations = dict(template["metadata"].get("annotations", {}))
            if indexed:
                name, hostname = f"{wname}-{i}-x7k2p", f"{wname}-{i}"
                annotations[INDEX_ANNOTATION] = str(i)
            elif obj["kind"] == "Job":
                name = hostname = f"{wname}-x7k2{chr(ord('a') + i)}"
            else:
                name = hostname = f"{wname}-{i}"
            meta = {
                "name": name,
                "namespace": ns,
                "labels": template["metadata"]["labels"],
                "annotations": annotations,
            }
            pods.append(
                _pod(
                    obj["kind"],
                    {"metadata": meta, "spec": template["spec"]},
                    hostname,
                    i if indexed else None,
                    configmaps,
                    secrets,
                    dns,
                    shared,
                    workdir / name,
                    cwd,
                )
            )
    return pods


def _pod(
    kind: str,
    pod: dict[str, Any],
    hostname: str,
    index: int | None,
    configmaps: dict[str, Any],
    secrets: dict[str, dict[str, str]],
    dns: re.Pattern[str],
    shared: dict[int, int],
    root: Path,
    cwd: Path,
) -> LocalPod:
    spec = pod["spec"]
    (container,) = spec["containers"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    paths: dict[str, str] = {}
    for mount in container.get("volumeMounts", []):
        vol = volumes[mount["name"]]
        local = root / "volumes" / mount["name"]
        if "persistentVolumeClaim" in vol:  # one directory per claim, shared by every pod
            local = root.parent / "claims" / vol["persistentVolumeClaim"]["claimName"]
        local.mkdir(parents=True, exist_ok=True)
        if "configMap" in vol:
            for key, text in configmaps[vol["configMap"]["name"]]["data"].items():
                (local / key).write_text(text)
        elif "emptyDir" not in vol and "persistentVolumeClaim" not in vol:
            raise ValueError(f"volume {vol} is not translated")
        paths[mount["mountPath"].rstrip("/")] = str(local)
    own = {
        p["containerPort"]: _free_port()
        for p in container.get("ports", [])
        if p["containerPort"] not in shared
    }
    ports = {**shared, **own}

    def local(value: str) -> str:
        value = dns.sub("127.0.0.1", value)
        parts = value.split(":")  # a path list (FLEET_PS_CHECKPOINT_ROOT): each path mapped
        if len(parts) > 1 and all(p.startswith(("/", ".")) for p in parts):
            return ":".join(local(p) for p in parts)
        for mount_path, where in paths.items():
            if value == mount_path or value.startswith(mount_path + "/"):
                value = where + value[len(mount_path) :]
        if value.isdigit() and int(value) in ports:
            value = str(ports[int(value)])
        hostport = re.fullmatch(r"127\.0\.0\.1:(\d+)", value)  # a service's host:port (env)
        if hostport and int(hostport.group(1)) in ports:
            value = f"127.0.0.1:{ports[int(hostport.group(1))]}"
        return value

    venv_bin = str(Path(sys.executable).parent)
    env = {
        "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(root),
        "HOSTNAME": hostname,
    }
    if index is not None:  # the Job controller sets it in an Indexed Job's pods only
        env["JOB_COMPLETION_INDEX"] = str(index)
    for item in container.get("env", []):
        if "value" in item:
            # $(NAME) of a variable listed earlier expands, as the kubelet does
            value = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: env.get(m.group(1), m.group(0)),
                str(item["value"]),
            )
            env[item["name"]] = local(value)
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = _field(item["valueFrom"]["fieldRef"]["fieldPath"], pod)
        elif "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            raise ValueError(f"env {item} is not translated")
    command = [local(a) for a in [*container["command"], *container.get("args", [])]]
    exe = shutil.which(command[0], path=env["PATH"])
    assert exe, f"{command[0]} not on {env['PATH']}"
    return LocalPod(
        pod["metadata"]["name"],
        kind,
        [exe, *command[1:]],
        env,
        str(container.get("workingDir") or cwd),
    )


def start(pod: LocalPod, log: Path) -> subprocess.Popen[bytes]:
    """Start a pod's process (own session, output to ``log``)."""
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            pod.argv,
            env=pod.env,
            cwd=pod.cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes], sig: int, timeout: float = 20.0) -> int:
    """Send ``sig`` to the pod process and wait; SIGKILL its group if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        return proc.wait(5)


HOLDING = "holding until the pod is deleted"


def _wait_for_hold(proc: subprocess.Popen[bytes], log: Path, deadline: float) -> None:
    """Until a StatefulSet pod's fleetrun says its processes stopped and it holds (what the
    launcher waits for before deleting the StatefulSet), it exits or ``deadline`` passes."""
    while time.monotonic() < deadline and proc.poll() is None:
        if HOLDING in log.read_text(errors="replace"):
            return
        time.sleep(0.1)


def run_pods(
    objs: list[dict[str, Any]], root: Path, repo: Path, timeout: float, hold_s: float = 30.0
) -> tuple[dict[str, int], dict[str, str]]:
    """Start every pod (StatefulSets first); wait for the Jobs' pods; then, once each
    StatefulSet pod holds (or after ``hold_s``), SIGTERM it as the launcher's cleanup deletes
    it. Returns exit codes and outputs by pod name; raises AssertionError with every pod's
    output tail when a Job's pod does not finish within ``timeout``."""
    pods = translate(objs, root / "pods", repo)
    procs: dict[str, tuple[LocalPod, subprocess.Popen[bytes]]] = {}
    logs = {pod.name: root / f"{pod.name}.out" for pod in pods}
    codes: dict[str, int] = {}
    try:
        for pod in sorted(pods, key=lambda p: p.kind != "StatefulSet"):
            procs[pod.name] = (pod, start(pod, logs[pod.name]))
        deadline = time.monotonic() + timeout
        for name, (pod, proc) in procs.items():
            if pod.kind == "Job":
                codes[name] = proc.wait(max(deadline - time.monotonic(), 1))
        hold_deadline = time.monotonic() + hold_s
        for name, (pod, proc) in procs.items():
            if pod.kind == "StatefulSet":
                _wait_for_hold(proc, logs[name], hold_deadline)
                codes[name] = stop(proc, signal.SIGTERM)
    except subprocess.TimeoutExpired:
        tails = "\n".join(f"--- {n}\n{logs[n].read_text()[-3000:]}" for n in procs)
        raise AssertionError(f"pods did not finish:\n{tails}") from None
    finally:
        for _, proc in procs.values():
            stop(proc, signal.SIGKILL, 5)
    return codes, {n: logs[n].read_text() for n in procs}
