"""SGLang's ``/generate`` for slime's plugins, served on loopback in front of the gateway.

slime's generate functions post SGLang's native body to
``http://{args.sglang_router_ip}:{args.sglang_router_port}/generate`` and read SGLang's answer
(``text``, ``meta_info.output_token_logprobs``, ``meta_info.finish_reason.type``,
``meta_info.weight_version``). tandem's learner never talks to engines: its samples come from the
gateway's ``POST /admin/rollouts`` (admin key, low priority, the gateway's bound on rollout
sequences). ``sglang_router`` serves the first on a loopback port while a round's plugins run and
turns each request into the second, one sample each; the plugins need no key.

What the gateway cannot do is refused with SGLang's 400 and a message saying so (streaming,
``n`` > 1, constraints other than ``json_schema``, stop token ids, batched prompts).
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

__all__ = ["GenerateError", "RouterRefusal", "generate_answer", "post_generate", "rollout_body", "sglang_router"]

log = logging.getLogger(__name__)

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's when sampling_params leave it out
_UNSERVED = ("regex", "ebnf", "structural_tag", "stop_token_ids", "logit_bias", "custom_params")


class RouterRefusal(ValueError):
    """A /generate request the gateway cannot serve (answered 400 with this message)."""


class GenerateError(RuntimeError):
    """The router refused a ``/generate`` call (the message is its answer)."""


async def post_generate(args: Any, body: dict[str, Any]) -> dict[str, Any]:
    """One SGLang ``/generate`` call through the router named by ``args`` (tandem's own generate
    functions: tool rollouts, workflows), answered as SGLang answers it."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
        response = await client.post(url, json=body)
    if response.status_code != 200:
        raise GenerateError(f"/generate answered {response.status_code}: {response.text[:500]}")
    answer: dict[str, Any] = response.json()
    return answer


def rollout_body(body: Any, routing_key: str | None) -> dict[str, Any]:
    """The gateway's ``/admin/rollouts`` body for one SGLang ``/generate`` body.

    Raises:
        RouterRefusal: not a JSON object, no prompt or two, or something the gateway does not serve.
    """
    if not isinstance(body, dict):
        raise RouterRefusal("the body must be a JSON object")
    if body.get("stream"):
        raise RouterRefusal("stream is not served by tandem's learner router; ask without it")
    prompts = [key for key in ("input_ids", "text") if body.get(key) is not None]
    if len(prompts) != 1:
        raise RouterRefusal("give exactly one of input_ids and text")
    prompt = body[prompts[0]]
    if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        raise RouterRefusal(f"{prompts[0]} must be one prompt ({'a string' if prompts[0] == 'text' else 'ints'})")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RouterRefusal("sampling_params must be an object")
    unserved = [key for key in _UNSERVED if params.get(key)]
    if params.get("n", 1) != 1:
        unserved.append("n != 1")
    if unserved:
        raise RouterRefusal(f"sampling_params {', '.join(unserved)}: not served by tandem's rollouts")
    request: dict[str, Any] = {
        prompts[0]: prompt,
        "n": 1,
        "max_tokens": params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS),
        "temperature": params.get("temperature", 1.0),
        "top_p": params.get("top_p", 1.0),
        "top_k": params.get("top_k", -1),
    }
    if params.get("stop"):
        request["stop"] = params["stop"]
    if params.get("sampling_seed") is not None:
        request["seed"] = params["sampling_seed"]
    if params.get("json_schema") is not None:
        request["json_schema"] = params["json_schema"]
    if body.get("return_routed_experts"):
        request["return_routed_experts"] = True
    if routing_key:
        request["session_id"] = routing_key  # slime's consistent-hashing key: same replica, warm cache
    return request


def generate_answer(rollouts: dict[str, Any], *, return_logprob: bool) -> dict[str, Any]:
    """SGLang's ``/generate`` answer for the gateway's answer to one ``rollout_body``."""
    choice = rollouts["choices"][0]
    output_ids = [int(t) for t in choice["output_ids"]]
    spans = sorted(choice["weight_versions"], key=lambda span: int(span["start"]))
    meta: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "finish_reason": {"type": choice["finish_reason"]},
        "prompt_tokens": len(rollouts["prompt_ids"]),
        "completion_tokens": len(output_ids),
        "cached_tokens": int(choice["cached_tokens"]),
    }
    if spans:
        meta["weight_version"] = str(spans[-1]["version"])  # SGLang reports the version that finished it
    if choice.get("routed_experts"):
        meta["routed_experts"] = choice["routed_experts"]
    if return_logprob:
        meta["output_token_logprobs"] = [
            [float(lp), token, None] for lp, token in zip(choice["logprobs"], output_ids, strict=True)
        ]
    return {"text": choice["text"], "output_ids": output_ids, "meta_info": meta}


class _Router(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog is 5: a round's concurrent generate calls overflowed it, and
    # the kernel reset their connections (SYN cookies) before a thread could take them.
    request_queue_size = 1024

    def __init__(self, gateway: httpx.Client) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.gateway = gateway


class _Handler(BaseHTTPRequestHandler):
    server: _Router

    def do_GET(self) -> None:
        if self.path in ("/health", "/health_generate"):
            self._answer(200, {})
        else:
            self._answer(404, {"error": {"message": f"{self.path}: tandem's learner router serves /generate"}})

    def do_POST(self) -> None:
        if self.path != "/generate":
            self._answer(404, {"error": {"message": f"{self.path}: tandem's learner router serves /generate"}})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"null")
            request = rollout_body(body, self.headers.get("x-smg-routing-key"))
        except (ValueError, RouterRefusal) as exc:
            self._answer(400, {"error": {"message": str(exc)}})
            return
        try:
            response = self.server.gateway.post("/admin/rollouts", json=request)
        except httpx.HTTPError as exc:
            self._answer(502, {"error": {"message": f"the gateway is unreachable: {exc!r}"}})
            return
        if response.status_code != 200:
            self._answer(response.status_code, _gateway_error(response))
            return
        self._answer(200, generate_answer(response.json(), return_logprob=bool(body.get("return_logprob"))))

    def _answer(self, status: int, data: dict[str, Any]) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("sglang router: " + format, *args)


def _gateway_error(response: httpx.Response) -> dict[str, Any]:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        error = None
    message = error.get("message") if isinstance(error, dict) else None
    return {"error": {"message": message or response.text[:300]}}


@contextmanager
def sglang_router(server_url: str, admin_key: str, *, timeout: float) -> Iterator[tuple[str, int]]:
    """Serve SGLang's ``/generate`` on a free loopback port, forwarding to the gateway at ``server_url``;
    yields ``(ip, port)`` for ``args.sglang_router_ip`` / ``args.sglang_router_port``."""
    gateway = httpx.Client(
        base_url=server_url.rstrip("/"), headers={"Authorization": f"Bearer {admin_key}"}, timeout=timeout
    )
    router = _Router(gateway)
    thread = threading.Thread(target=router.serve_forever, name="sglang-router", daemon=True)
    thread.start()
    try:
        host, port = router.server_address[:2]
        yield str(host), int(port)
    finally:
        router.shutdown()
        router.server_close()
        thread.join()
        gateway.close()
