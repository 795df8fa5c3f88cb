"""The simulated server's side routes, each answered as the persona's server answers it: token counting and where
the context window is stated.

Token counts here and the context check on chat requests count alike (tmas.testing.responders.chat_prompt_tokens):
a chat prompt is rendered by :func:`render_chat`, whose wrapper around each message counts exactly the per-message
overhead the context check adds. A route the persona's server does not have answers 404.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any, Protocol

from aiohttp import web

from tmas.testing.personas import Persona
from tmas.testing.responders import TOKEN_RE, chat_prompt_tokens, content_text, count_tokens
from tmas.testing.script import SimScript
from tmas.testing.sim_queue import RunQueue
from tmas.testing.sim_stats import SimRecorder


class SimApp(Protocol):
    """What these routes read of the simulator's app (tmas.testing.sim_routes.SimApp)."""

    queue: RunQueue
    recorder: SimRecorder

    @property
    def script(self) -> SimScript: ...

    @property
    def persona(self) -> Persona: ...


# Stand-in vocabulary size for token ids (a Qwen3 tokenizer's).
_VOCAB = 151936


def render_chat(messages: list[dict[str, Any]]) -> str:
    """A chat prompt as the simulator's template renders it: ``[role]``, the content, and a closing ``.`` line, so
    each message costs its text's tokens plus the 4 of its wrapper, as ``chat_prompt_tokens`` counts."""
    return "".join(f"[{m.get('role')}]\n{content_text(m.get('content'))}\n.\n" for m in messages)


def token_ids(text: str) -> list[int]:
    """Stand-in token ids for ``text``, one per simulator token, the same in every process."""
    return [zlib.crc32(t.encode()) % _VOCAB for t in TOKEN_RE.findall(text)]


def _pieces(text: str) -> list[str]:
    return TOKEN_RE.findall(text)


async def _json_body(request: web.Request) -> dict[str, Any] | None:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def _not_found() -> web.Response:
    return web.json_response({"detail": "Not Found"}, status=404)


class InfoRoutes:
    """Token counting and context-window routes for :class:`SimApp`."""

    def __init__(self, sim: SimApp) -> None:
        self.sim = sim

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/tokenize", self.sglang_tokenize)
        app.router.add_post("/apply-template", self.apply_template)
        app.router.add_get("/props", self.props)
        for path in ("/get_model_info", "/model_info"):
            app.router.add_get(path, self.sglang_model_info)
        for path in ("/get_server_info", "/server_info"):
            app.router.add_get(path, self.sglang_server_info)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/get_load", self.sglang_load)
        app.router.add_get("/slots", self.llama_slots)

    def _bad(self, message: str) -> web.Response:
        persona = self.sim.persona
        return web.json_response(persona.error(400, message, None, None), status=400)

    # ---- POST /tokenize: vLLM's, SGLang's or llama-server's, by persona -------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        name = self.sim.persona.name
        if not self.sim.script.tokenize:
            return _not_found()
        if name == "sglang":
            return await self.sglang_tokenize(request)
        if name == "llama-server":
            return await self._llama_tokenize(request)
        if name == "openai":
            return _not_found()
        return await self._vllm_tokenize(request)

    async def _vllm_tokenize(self, request: web.Request) -> web.Response:
        # vllm/entrypoints/serve/tokenize (serving_tokenization.py; protocol TokenizeChatRequest /
        # TokenizeCompletionRequest, TokenizeResponse): "messages" (rendered with the chat template) or "prompt";
        # the reply counts the tokens and states max_model_len.
        body = await _json_body(request)
        if body is None:
            return self._bad("Request body is not a JSON object.")
        messages = body.get("messages")
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            text = render_chat(messages)
            count = chat_prompt_tokens([content_text(m.get("content")) for m in messages])
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
            count = count_tokens(text)
        else:
            return self._bad("Either 'messages' or 'prompt' is required.")
        script = self.sim.script
        return web.json_response(
            {
                "count": count,
                "max_model_len": script.context_length,
                "tokens": token_ids(text),
                "token_strs": _pieces(text) if body.get("return_token_strs") else None,
            }
        )

    async def sglang_tokenize(self, request: web.Request) -> web.Response:
        # python/sglang/srt/entrypoints/openai/serving_tokenize.py: "prompt" (a string or a list of them) only, no
        # messages; "tokens", "count" and "max_model_len". The real server reports its tokenizer's
        # model_max_length there, which need not be the served context length; the simulator reports the latter.
        if self.sim.persona.name != "sglang" or not self.sim.script.tokenize:
            return _not_found()
        body = await _json_body(request)
        prompt = body.get("prompt") if body is not None else None
        limit = self.sim.script.context_length
        if isinstance(prompt, str):
            return web.json_response(
                {"tokens": token_ids(prompt), "count": count_tokens(prompt), "max_model_len": limit}
            )
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            return web.json_response(
                {
                    "tokens": [token_ids(p) for p in prompt],
                    "count": [count_tokens(p) for p in prompt],
                    "max_model_len": limit,
                }
            )
        return self._bad(f"Invalid prompt type: {type(prompt)}. Expected str or List[str].")

    async def _llama_tokenize(self, request: web.Request) -> web.Response:
        # tools/server/server-context.cpp (tokenize handler): "content"; "with_pieces" answers {id, piece} pairs.
        body = await _json_body(request)
        content = body.get("content") if body is not None else None
        if not isinstance(content, str):
            return web.json_response({"tokens": []})
        if body is not None and body.get("with_pieces"):
            pairs = zip(token_ids(content), _pieces(content), strict=True)
            return web.json_response({"tokens": [{"id": i, "piece": p} for i, p in pairs]})
        return web.json_response({"tokens": token_ids(content)})

    async def apply_template(self, request: web.Request) -> web.Response:
        # tools/server/server-context.cpp (apply-template handler): the chat messages rendered with the model's
        # template, as "prompt"; /tokenize of that prompt counts what the context check counts.
        if self.sim.persona.name != "llama-server" or not self.sim.script.tokenize:
            return _not_found()
        body = await _json_body(request)
        messages = body.get("messages") if body is not None else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return self._bad("'messages' is required")
        return web.json_response({"prompt": render_chat(messages)})

    # ---- where the context window is stated ------------------------------------------------------------------

    async def props(self, request: web.Request) -> web.Response:
        # tools/server/server-context.cpp get_props: default_generation_settings.n_ctx is the context of one slot
        # (the -c total divided among the -np slots), which is what SimScript.context_length stands for here.
        if self.sim.persona.name != "llama-server":
            return _not_found()
        script = self.sim.script
        params = {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": -1}
        return web.json_response(
            {
                "default_generation_settings": {"params": params, "n_ctx": script.context_length},
                "total_slots": script.slots,
                "model_alias": script.model,
                "model_path": f"/models/{script.model}.gguf",
                "modalities": {"vision": False, "audio": False},
                "endpoint_slots": True,
                "endpoint_props": False,
                "endpoint_metrics": False,
                "chat_template": "",
                "build_info": "b0-sim",
            }
        )

    async def sglang_model_info(self, request: web.Request) -> web.Response:
        # python/sglang/srt/entrypoints/http_server.py get_model_info (/get_model_info, and /model_info in newer
        # releases): what model this is, not its context window.
        if self.sim.persona.name != "sglang":
            return _not_found()
        model = self.sim.script.model
        return web.json_response(
            {
                "model_path": model,
                "tokenizer_path": model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
            }
        )

    async def sglang_server_info(self, request: web.Request) -> web.Response:
        # python/sglang/srt/entrypoints/http_server.py get_server_info (/get_server_info, /server_info): the server
        # arguments (context_length among them) with the scheduler's figures. The simulator answers the few a
        # client reads.
        if self.sim.persona.name != "sglang":
            return _not_found()
        script = self.sim.script
        return web.json_response(
            {
                "model_path": script.model,
                "served_model_name": script.model,
                "context_length": script.context_length,
                "max_running_requests": script.max_running,
                "version": "sim",
            }
        )

    # ---- load: requests running and waiting (SimScript.max_running) -----------------------------------------

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text with the run queue's gauges and the engine's progress counters, under each server's metric
        names."""
        name, script = self.sim.persona.name, self.sim.script
        if name == "sglang" and not script.metrics:
            return _not_found()  # started without --enable-metrics
        if name == "llama-server" and not script.metrics:
            # server-context.cpp get_metrics without --metrics: ERROR_TYPE_NOT_SUPPORTED.
            message = "This server does not support metrics endpoint. Start it with `--metrics`"
            body = {"error": {"code": 501, "message": message, "type": "not_supported_error"}}
            return web.json_response(body, status=501)
        if name == "llama-server":
            await self._llama_main_loop()
        running, waiting = self.sim.queue.running, self.sim.queue.waiting
        stats = self.sim.recorder.stats()
        prompt, generated = stats.engine_prompt_tokens, stats.engine_generated_tokens
        model = script.model
        if name in ("vllm", "sim"):
            # vllm/v1/metrics/loggers.py PrometheusStatLogger: gauges and counters labelled with the model and the
            # engine, recorded every engine step.
            labels = f'{{engine="0",model_name="{model}"}}'
            series = [
                ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", running),
                ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", waiting),
                ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", prompt),
                ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", generated),
            ]
        elif name == "sglang":
            # python/sglang/srt/metrics/collector.py (with --enable-metrics).
            labels = f'{{model_name="{model}"}}'
            series = [
                ("sglang:num_running_reqs", "gauge", "The number of running requests.", running),
                ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", waiting),
                ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.", prompt),
                ("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.", generated),
            ]
        elif name == "llama-server":
            # server-task.cpp server_task_result_metrics::to_metrics (with --metrics).
            labels = ""
            series = [
                ("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", prompt),
                ("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.", generated),
                ("llamacpp:requests_processing", "gauge", "Number of requests processing.", running),
                ("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", waiting),
            ]
        else:
            return _not_found()
        lines: list[str] = []
        for metric, kind, doc, value in series:
            lines += [f"# HELP {metric} {doc}", f"# TYPE {metric} {kind}", f"{metric}{labels} {float(value)}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _llama_main_loop(self) -> None:
        """llama-server answers /metrics and /slots from its main loop (server-context.cpp posts them as tasks): a
        wedged one answers only once the wedge is gone, or after ``hang_s``."""
        script = self.sim.script
        waited = 0.0
        while self.sim.script.wedged and waited < script.hang_s:
            await asyncio.sleep(0.02)
            waited += 0.02

    async def sglang_load(self, request: web.Request) -> web.Response:
        # python/sglang/srt/entrypoints/http_server.py get_load: one entry per data-parallel rank (one here), its
        # requests (running and waiting), those waiting, and its tokens in use (not simulated: 0).
        if self.sim.persona.name != "sglang":
            return _not_found()
        running, waiting = self.sim.queue.running, self.sim.queue.waiting
        stats = self.sim.recorder.stats()
        # num_tokens: the simulator's stand-in for the tokens in use, its engine's counters (they move while it works).
        tokens = stats.engine_prompt_tokens + stats.engine_generated_tokens
        entry = {"rid": None, "http_worker_ipc": None, "dp_rank": None, "num_reqs": running + waiting}
        return web.json_response([{**entry, "num_waiting_reqs": waiting, "num_tokens": tokens}])

    async def llama_slots(self, request: web.Request) -> web.Response:
        # tools/server/server-context.cpp slots handler: one object per slot; as many as are generating say
        # is_processing (the requests waiting for a slot are not listed: /metrics counts them as deferred).
        if self.sim.persona.name != "llama-server":
            return _not_found()
        await self._llama_main_loop()
        script = self.sim.script
        busy = self.sim.queue.running
        slots = [
            {"id": i, "id_task": -1, "n_ctx": script.context_length, "speculative": False, "is_processing": i < busy}
            for i in range(script.slots)
        ]
        return web.json_response(slots)
