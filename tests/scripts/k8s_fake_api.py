"""A tiny in-memory stand-in for the Kubernetes API server, for the k8s_client tests only.

It speaks the REST paths fleetrun's client calls (create / get / list by ``labelSelector`` /
merge-patch / delete of namespaced objects, pod logs) over HTTP on 127.0.0.1, port 0, and
records every request. It is not Kubernetes: no controllers (the test plays the Job controller
by editing :attr:`FakeAPI.objects`), no validation, no watch, no auth. What it checks is that the
official client, as fleetrun calls it, sends the requests fleetrun means (paths, bodies, order).
"""

from __future__ import annotations

import copy
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

KINDS = {
    "jobs": "Job",
    "statefulsets": "StatefulSet",
    "services": "Service",
    "configmaps": "ConfigMap",
    "secrets": "Secret",
    "pods": "Pod",
    "podgroups": "PodGroup",
}


def _merge(dst: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        else:
            dst[key] = value


class FakeAPI:
    """The server and its state: ``objects[(plural, namespace, name)] = body``."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.fail: dict[tuple[str, str], int] = {}
        """``(method, plural) -> HTTP status`` to answer instead (e.g. 403)."""
        self.lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any, text: bool = False) -> None:
                data = body.encode() if text else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> Any:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n)) if n else None

            def _handle(self, method: str) -> None:
                url = urlparse(self.path)
                parts = url.path.strip("/").split("/")
                body = self._body() if method in ("POST", "PATCH", "DELETE") else None
                with api.lock:
                    api.requests.append((method, url.path, copy.deepcopy(body)))
                    code, out, text = api.route(method, parts, parse_qs(url.query), body)
                self._send(code, out, text)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_PATCH(self) -> None:
                self._handle("PATCH")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def write_kubeconfig(self, path: Path) -> None:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }
        path.write_text(json.dumps(cfg))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def _status(code: int, reason: str) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "code": code,
            "reason": reason,
            "message": reason,
        }

    def route(
        self, method: str, parts: list[str], query: dict[str, list[str]], body: Any
    ) -> tuple[int, Any, bool]:
        """(status, body, is_text) for one request (called under the lock)."""
        i = parts.index("namespaces")
        ns, rest = parts[i + 1], parts[i + 2 :]
        plural = rest[0]
        if (method, plural) in self.fail:
            code = self.fail[(method, plural)]
            return code, self._status(code, "Forbidden" if code == 403 else "Failure"), False
        if method == "POST":
            name = body["metadata"]["name"]
            if (plural, ns, name) in self.objects:
                return 409, self._status(409, "AlreadyExists"), False
            body.setdefault("metadata", {})["uid"] = str(uuid.uuid4())
            body["metadata"]["namespace"] = ns
            self.objects[(plural, ns, name)] = body
            return 201, body, False
        if len(rest) == 1:  # collection
            sel = query.get("labelSelector", [""])[0]
            key, _, value = sel.partition("=")
            items = [
                o
                for (p, n, _), o in sorted(self.objects.items())
                if p == plural
                and n == ns
                and (not sel or o["metadata"].get("labels", {}).get(key) == value)
            ]
            kind = KINDS[plural]
            return (
                200,
                {"kind": f"{kind}List", "apiVersion": "v1", "metadata": {}, "items": items},
                False,
            )
        name = rest[1]
        obj = self.objects.get((plural, ns, name))
        if obj is None:
            return 404, self._status(404, "NotFound"), False
        if len(rest) == 3 and rest[2] == "log":
            return 200, f"log of {name}\n", True
        if method == "PATCH":
            _merge(obj, body)
            return 200, obj, False
        if method == "DELETE":
            del self.objects[(plural, ns, name)]
            # the garbage collector's part, for the objects no fleetrun call deletes (the PS
            # token Secret): what the deleted object owned goes with it
            uid = obj.get("metadata", {}).get("uid")
            for key, other in list(self.objects.items()):
                refs = other.get("metadata", {}).get("ownerReferences") or []
                if key[0] == "secrets" and uid and any(r.get("uid") == uid for r in refs):
                    del self.objects[key]
            if plural in ("services", "podgroups"):  # as the API server: the deleted object
                return 200, obj, False
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}, False
        return 200, obj, False

    # -- playing the controllers --------------------------------------------------------------
    def add_pod(
        self,
        ns: str,
        name: str,
        labels: dict[str, str],
        annotations: dict[str, str],
        phase: str,
        exit_code: int | None = None,
        message: str = "",
        last_exit: int | None = None,
    ) -> None:
        """A pod as the Job / StatefulSet controller and the kubelet would leave it."""
        status: dict[str, Any] = {"phase": phase}
        state: dict[str, Any] = (
            {"running": {}}
            if exit_code is None
            else {
                "terminated": {
                    "exitCode": exit_code,
                    "message": message,
                    "reason": "Error" if exit_code else "Completed",
                }
            }
        )
        cs: dict[str, Any] = {
            "name": "c",
            "image": "fleetrun",
            "imageID": "",
            "ready": exit_code is None,
            "restartCount": 0 if last_exit is None else 1,
            "state": state,
        }
        if last_exit is not None:
            cs["lastState"] = {"terminated": {"exitCode": last_exit, "message": message}}
        status["containerStatuses"] = [cs]
        with self.lock:
            self.objects[("pods", ns, name)] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": ns,
                    "labels": labels,
                    "annotations": annotations,
                    "uid": str(uuid.uuid4()),
                },
                "spec": {"containers": [{"name": "c", "image": "fleetrun"}]},
                "status": status,
            }

    def set_job_condition(self, ns: str, name: str, cond: str, **counts: int) -> None:
        with self.lock:
            job = self.objects[("jobs", ns, name)]
            job["status"] = {"conditions": [{"type": cond, "status": "True"}], **counts}
