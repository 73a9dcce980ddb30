"""Test servers on 127.0.0.1: a fault-injecting one that speaks the OpenAI chat API, TEI's /predict and vLLM's
/classify and answers each request as its script says (429 with or without Retry-After, 500, slow, broken JSON, a
dropped connection, a good answer), and the scoring of a real tiny sequence-classification model behind the same
two reward-model APIs."""

from __future__ import annotations

import collections
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_completion(content: str, model: str = "judge") -> dict:
    return {"id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self._reply(200, {"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        fault = self.server.owner
        with fault.lock:
            fault.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body,
                                   "time": time.monotonic()})
            action = fault.script.popleft() if fault.script else ("ok",)
            fault.in_flight += 1
            fault.max_in_flight = max(fault.max_in_flight, fault.in_flight)
        self._answered = False
        try:
            self._act(action, body)
        finally:
            self._answering()

    def _answering(self):
        """A request stops counting as in flight when its answer starts to go out: the client may send its next one
        as soon as it has read it, before this handler's thread gets back here."""
        if not getattr(self, "_answered", True):
            self._answered = True
            with self.server.owner.lock:
                self.server.owner.in_flight -= 1

    def _act(self, action: tuple, body: dict):
        fault = self.server.owner
        kind = action[0]
        if kind == "status":
            _, code, headers = action
            self._reply(code, {"error": {"message": f"injected {code}", "type": "test"}}, headers)
        elif kind == "broken":
            self._raw(200, b'{"id": "x", "choices": [{"index": 0, "mess')
        elif kind == "drop":
            self.close_connection = True
            self._answering()
            self.connection.shutdown(socket.SHUT_RDWR)
        else:
            if kind == "slow":
                time.sleep(action[1])
            try:
                self._reply(200, fault.answer(self.path, body))
            except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting: expected for "slow"
                pass

    def _raw(self, code: int, data: bytes, headers: dict | None = None):
        self._answering()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _reply(self, code: int, obj: Any, headers: dict | None = None):
        self._raw(code, json.dumps(obj).encode(), headers)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: FaultServer


class FaultServer:
    """``script``: actions consumed one per request, ``("ok",)`` when it is empty: ``("status", code, headers)``,
    ``("slow", seconds)`` (then a good answer), ``("broken",)`` (a 200 with half a JSON body), ``("drop",)`` (the
    connection closed without an answer). ``judge_reply(body) -> str`` writes the judge's good answers;
    ``reward_model(texts) -> list[float]`` the reward model's. ``requests`` records every request."""

    def __init__(self):
        self.script: collections.deque = collections.deque()
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.judge_reply = lambda body: "Score: 8"
        self.reward_model = lambda texts: [float(len(t)) for t in texts]
        self.in_flight = self.max_in_flight = 0
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    def __enter__(self) -> FaultServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def paths(self) -> list[str]:
        return [r["path"] for r in self.requests]

    def answer(self, path: str, body: dict) -> Any:
        if path.endswith("/chat/completions"):
            return chat_completion(self.judge_reply(body), body.get("model", "judge"))
        if path.endswith("/predict"):
            scores = self.reward_model(list(body["inputs"]))
            return [[{"label": f"LABEL_{j}", "score": s} for j, s in enumerate(row if isinstance(row, list) else [row])]
                    for row in scores]
        if path.endswith("/classify"):
            scores = self.reward_model(list(body["input"]))
            data = [{"index": i, "label": "LABEL_0", "probs": row if isinstance(row, list) else [row],
                     "num_classes": len(row) if isinstance(row, list) else 1} for i, row in enumerate(scores)]
            return {"id": "classify-test", "object": "list", "created": 0, "model": body.get("model"),
                    "data": list(reversed(data))}  # out of order on purpose: the client must sort by index
        return {"error": "unknown path"}
