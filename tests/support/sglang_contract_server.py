"""A loopback server that answers like SGLang 0.5.23's OpenAI-compatible endpoints.

SGLang needs a GPU, so the SGLang engine is tested against this double. It does not guess the
wire format: it loads SGLang's own pydantic classes (``sglang/srt/entrypoints/openai/protocol.py``
from the released 0.5.23 wheel, fetched with pip into ``.cache/sglang-0.5.23/`` on first use,
never committed) and fills them the way ``serving_chat.py``'s ``_build_chat_response`` does,
with real tokens and logprobs from the in-process ``LocalEngine`` underneath:

- ``meta_info`` as ``TokenizerManager._handle_batch_output`` builds it (finish_reason dict with
  ``matched``, ``output_token_logprobs`` ``[logprob, id, text]`` triples, ``weight_version``,
  ``cached_tokens``), mutated to ``tool_calls`` when the tool parser finds calls, as SGLang does;
- ``prompt_token_ids`` / ``response_token_ids`` / ``meta_info`` / ``sglext`` per request flag
  (and the ``x-sglext-return-*-ids: 1`` headers);
- errors as ``ErrorResponse`` with SGLang's messages (context length, streaming + token ids,
  validation), ``/v1/tokenize``, ``/update_weights_from_disk``, ``/v1/models``, ``/health``;
- ``/v1/completions`` with a token-id prompt (token input), read as ``CompletionRequest`` and answered as
  ``serving_completions._build_completion_response`` builds a ``CompletionResponse``: ``text`` (special tokens
  skipped, a stop string trimmed), ``logprobs.token_logprobs`` from the same triples, ``token_ids`` and
  ``prompt_token_ids`` with ``return_token_ids``, ``metadata.weight_version``. Under a ``ScriptedEngine`` it
  replays the script's turn due at that prompt (the number of assistant turns the prompt holds) as the tokens
  the template writes for it, scored after exactly the given ids; ``completion_prompts`` keeps every prompt.

``server.configured(variant=...)`` picks the shape of another SGLang build for the same request:
``release`` (0.5.23, default), ``token_ids`` (main-branch naming of mid-2026: ``token_ids`` instead
of ``response_token_ids``), ``sglext`` (ids only through ``sglext``, no per-choice extras),
``meta_info_only`` (before ``return_token_ids`` existed: prompt ids + meta_info triples).
Fault injection for error paths: ``fail="internal"`` (500 ErrorResponse), ``"misaligned"``
(triples for one token fewer than the ids), ``"no_ids"`` (no token ids at all), ``"not_json"``,
``"sentinel_logprob"`` (the first token's logprob is -9999.0, the value vLLM writes for -inf);
``delay_s=N`` answers N seconds late.

The engine underneath is a ``LocalEngine`` or a ``ScriptedEngine`` (for tool calls).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib.util
import subprocess
import sys
import threading
import time
import types
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from polar_addon.canonical import AssistantMessage, CanonicalRequest, Completion, PolarError, SamplingParams
from polar_addon.engines.local import LocalEngine
from polar_addon.engines.scripted import ScriptedEngine

SGLANG_VERSION = "0.5.23"
MSGSPEC_VERSION = "0.23.0"  # protocol.py imports msgspec; the main venv does not ship it
REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO / ".cache" / f"sglang-{SGLANG_VERSION}"
PROTOCOL_IN_WHEEL = "sglang/srt/entrypoints/openai/protocol.py"
UTILS_IN_WHEEL = "sglang/utils.py"
# /update_weights_from_disk's body is io_struct's UpdateWeightFromDiskReqInput (a msgspec Struct validated by FastAPI
# through msgspec_utils' pydantic schema); io_struct imports all of SGLang, so the two classes are taken verbatim.
IO_STRUCT_IN_WHEEL = "sglang/srt/managers/io_struct.py"
MSGSPEC_UTILS_IN_WHEEL = "sglang/srt/utils/msgspec_utils.py"
WHEEL_MEMBERS = (PROTOCOL_IN_WHEEL, UTILS_IN_WHEEL, IO_STRUCT_IN_WHEEL, MSGSPEC_UTILS_IN_WHEEL)
MODULE_NAME = "sglang.srt.entrypoints.openai.protocol"
VARIANTS = ("release", "token_ids", "sglext", "meta_info_only")
FAULTS = ("", "internal", "misaligned", "no_ids", "not_json", "sentinel_logprob")
STREAM_REFUSALS = {  # serving_chat._convert_to_internal_request
    "return_prompt_token_ids": "return_prompt_token_ids is not supported with streaming. "
    "Please set stream=false when using return_prompt_token_ids=true.",
    "return_token_ids": "return_token_ids is not supported with streaming on /v1/chat/completions. "
    "Please set stream=false when using return_token_ids=true.",
    "return_meta_info": "return_meta_info is not supported with streaming. "
    "Please set stream=false when using return_meta_info=true.",
}


class ContractUnavailable(RuntimeError):
    """SGLang's wheel could not be fetched (no registry access); the contract tests fail with this reason."""


def _pip_download(requirement: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-q",
        "-d",
        str(dest),
        requirement,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    name = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(dest.glob(f"{name}-*.whl"))
    if result.returncode != 0 or not wheels:
        raise ContractUnavailable(f"pip download {requirement} failed: {result.stderr.strip()[-500:]}")
    return wheels[-1]


def _prepare(cache_dir: Path) -> tuple[Path, Path]:
    """Extract protocol.py and sglang/utils.py from the wheel (once); make msgspec importable."""
    protocol = cache_dir / PROTOCOL_IN_WHEEL
    utils = cache_dir / UTILS_IN_WHEEL
    if not all((cache_dir / member).exists() for member in WHEEL_MEMBERS):
        wheel = _pip_download(f"sglang=={SGLANG_VERSION}", cache_dir / "wheels")
        with zipfile.ZipFile(wheel) as zf:
            for member in WHEEL_MEMBERS:
                zf.extract(member, cache_dir)
    try:
        import msgspec  # noqa: F401
    except ImportError:
        deps = cache_dir / "deps"
        if not (deps / "msgspec").is_dir():
            wheel = _pip_download(f"msgspec=={MSGSPEC_VERSION}", cache_dir / "wheels")
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(deps)
        sys.path.insert(0, str(deps))
    return protocol, utils


def load_protocol(cache_dir: Path = CACHE_DIR) -> types.ModuleType:
    """SGLang 0.5.23's ``protocol`` module, loaded without the rest of SGLang.

    It imports only ``convert_json_schema_to_str`` from ``sglang.utils``, whose module pulls in
    much of SGLang; a stand-in module holds that one function, taken verbatim from the wheel.
    """
    if MODULE_NAME in sys.modules:
        return sys.modules[MODULE_NAME]
    protocol_path, utils_path = _prepare(cache_dir)
    source = utils_path.read_text()
    [func] = [
        n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "convert_json_schema_to_str"
    ]
    utils = types.ModuleType("sglang.utils")
    exec("import json\nfrom typing import Type, Union\nfrom pydantic import BaseModel\n", utils.__dict__)
    exec(ast.get_source_segment(source, func), utils.__dict__)
    package = types.ModuleType("sglang")
    package.__path__ = []  # a namespace stand-in: nothing else of sglang is importable
    package.utils = utils  # type: ignore[attr-defined]
    sys.modules.setdefault("sglang", package)
    sys.modules["sglang.utils"] = utils
    spec = importlib.util.spec_from_file_location(MODULE_NAME, protocol_path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    # pydantic resolves the postponed annotations through sys.modules[MODULE_NAME].
    sys.modules[MODULE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[MODULE_NAME]
        raise
    return module


def load_update_weights_input(cache_dir: Path = CACHE_DIR) -> type:
    """SGLang 0.5.23's ``UpdateWeightFromDiskReqInput`` (with its base ``BaseReq``), its source taken verbatim from the
    wheel's io_struct.py and run with msgspec_utils.py's own pydantic schema, as FastAPI validates the route's body."""
    _prepare(cache_dir)
    io_source = (cache_dir / IO_STRUCT_IN_WHEEL).read_text()
    wanted = ("BaseReq", "UpdateWeightFromDiskReqInput")
    classes = {n.name: n for n in ast.parse(io_source).body if isinstance(n, ast.ClassDef) and n.name in wanted}
    spec = importlib.util.spec_from_file_location("sglang.srt.utils.msgspec_utils", cache_dir / MSGSPEC_UTILS_IN_WHEEL)
    assert spec and spec.loader
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    # A module of its own in sys.modules: msgspec resolves the postponed annotations through the class's module.
    module = types.ModuleType("sglang.srt.managers.io_struct")
    sys.modules[module.__name__] = module
    module.msgspec_struct_pydantic_core_schema = utils.msgspec_struct_pydantic_core_schema  # type: ignore[attr-defined]
    exec(
        "from __future__ import annotations\nfrom typing import Any, Dict, List, Optional\nimport msgspec\n",
        module.__dict__,
    )
    for name in wanted:
        exec(
            compile(
                "from __future__ import annotations\n" + ast.get_source_segment(io_source, classes[name]),
                module.__name__,
                "exec",
            ),
            module.__dict__,
        )
    return module.UpdateWeightFromDiskReqInput


class SGLangContractServer:
    """``with SGLangContractServer(engine) as server: server.url`` -> ``http://127.0.0.1:PORT``."""

    def __init__(
        self,
        engine: LocalEngine | ScriptedEngine,
        *,
        protocol: types.ModuleType | None = None,
        served_model: str = "tiny",
        context_len: int = 4096,
        weight_version: str = "default",
    ) -> None:
        self.p = protocol or load_protocol()
        self.update_weights_input = load_update_weights_input()
        self.weight_updates: list[Any] = []  # every validated UpdateWeightFromDiskReqInput, in order
        self.engine = engine
        self.local = engine.local if isinstance(engine, ScriptedEngine) else engine
        self.variant = "release"
        self.fail = ""
        self.delay_s = 0.0
        self.served_model = served_model
        self.context_len = context_len
        self.weight_version = weight_version
        self.requests: list[dict[str, Any]] = []  # raw bodies received, for assertions
        self.completion_prompts: list[list[int]] = []  # the token-id prompts /v1/completions sampled after
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    # --- lifecycle (the server runs in its own thread and loop, so tests may use asyncio.run) ---

    def __enter__(self) -> SGLangContractServer:
        ready = threading.Event()
        errors: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._start())
            except BaseException as exc:  # surfaced to the caller below
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())  # type: ignore[union-attr]
            loop.close()

        self._thread = threading.Thread(target=serve, name="sglang-contract", daemon=True)
        self._thread.start()
        ready.wait(60)
        if errors:
            raise errors[0]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(30)

    async def _start(self) -> None:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/tokenize", self.tokenize)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/health", self.health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    @contextlib.contextmanager
    def configured(self, *, variant: str = "release", fail: str = "", delay_s: float = 0.0) -> Iterator[None]:
        """Answer as another SGLang build, or inject a fault, inside the ``with`` block."""
        if variant not in VARIANTS or fail not in FAULTS:
            raise ValueError(f"variant must be one of {VARIANTS}, fail one of {FAULTS}")
        self.variant, self.fail, self.delay_s = variant, fail, delay_s
        try:
            yield
        finally:
            self.variant, self.fail, self.delay_s = "release", "", 0.0

    # --- helpers -----------------------------------------------------------------------------

    @staticmethod
    def _json(content: Any, status: int = 200) -> web.Response:
        return web.Response(body=orjson.dumps(content), status=status, content_type="application/json")

    def _error(self, message: str, err_type: str = "BadRequestError", status: int = 400) -> web.Response:
        """``OpenAIServingBase.create_error_response``."""
        error = self.p.ErrorResponse(object="error", message=message, type=err_type, param=None, code=status)
        return self._json(error.model_dump(), status)

    async def _read(self, request: web.Request, model: Any) -> Any:
        """Body -> pydantic request, or the 400 SGLang's RequestValidationError handler sends."""
        if request.content_type != "application/json":
            raise _Reply(self._error("Unsupported Media Type: Only 'application/json' is allowed", "Bad Request"))
        raw = await request.read()
        try:
            body = orjson.loads(raw)
            self.requests.append(body)
            return body, model.model_validate(body)
        except orjson.JSONDecodeError as exc:
            raise _Reply(self._error(f"JSON decode error: {exc}", "Bad Request")) from exc
        except Exception as exc:  # pydantic.ValidationError
            errors = exc.errors() if hasattr(exc, "errors") else []
            raise _Reply(self._error(f"{exc} {errors}", "Bad Request")) from exc

    def _canonical(self, body: dict[str, Any], req: Any) -> CanonicalRequest:
        stop = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
        kwargs = req.chat_template_kwargs or {}
        return CanonicalRequest(
            api="sglang",
            model=req.model,
            messages=body["messages"],
            tools=body.get("tools") or [],
            sampling=SamplingParams(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                max_tokens=body.get("max_completion_tokens") or body.get("max_tokens"),
                stop=stop,
                seed=req.seed,
            ),
            enable_thinking=kwargs.get("enable_thinking"),
        )

    # --- routes --------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.Response:
        try:
            body, req = await self._read(request, self.p.ChatCompletionRequest)
        except _Reply as reply:
            return reply.response
        fail, variant = self.fail, self.variant
        await asyncio.sleep(self.delay_s)
        if fail == "internal":
            return self._error(
                "Internal server error: CUDA error: an illegal memory access", "InternalServerError", 500
            )
        if fail == "not_json":
            return web.Response(text="<html>502 Bad Gateway</html>", status=200, content_type="text/html")

        if request.headers.get("x-sglext-return-input-ids") == "1":
            req.return_input_ids_in_sglext = True
        if request.headers.get("x-sglext-return-output-ids") == "1":
            req.return_output_ids_in_sglext = True
        if req.stream:
            for flag, message in STREAM_REFUSALS.items():
                if getattr(req, flag):
                    return self._error(message, "BadRequest")
            return self._error("contract server: streaming is not reproduced", "BadRequest")
        # What the emulated build supports decides which extras it honours.
        if variant == "sglext":
            req.return_input_ids_in_sglext = (
                req.return_input_ids_in_sglext or req.return_prompt_token_ids or req.return_token_ids
            )
            req.return_output_ids_in_sglext = req.return_output_ids_in_sglext or req.return_token_ids
            req.return_prompt_token_ids = req.return_token_ids = req.return_meta_info = False
        elif variant == "meta_info_only":
            req.return_prompt_token_ids = req.return_prompt_token_ids or req.return_token_ids
            req.return_token_ids = False

        canonical = self._canonical(body, req)
        try:
            prompt_len = await self.engine.count_tokens(canonical)
            if prompt_len >= self.context_len:
                # TokenizerManager._validate_one_request
                raise ValueError(
                    f"The input ({prompt_len} tokens) is longer than the model's context length "
                    f"({self.context_len} tokens)."
                )
            completion = await self.engine.complete(canonical)
        except ValueError as exc:
            return self._error(str(exc))
        except PolarError as exc:
            return self._error(exc.message, status=exc.status)

        ret = self._ret_item(completion, return_logprob=bool(req.logprobs))
        response = self._build_chat_response(req, ret, completion)
        data = response.model_dump()
        choice = data["choices"][0]
        if variant == "token_ids" and "response_token_ids" in choice:
            choice["token_ids"] = choice.pop("response_token_ids")
        if fail == "misaligned":
            choice["meta_info"]["output_token_logprobs"] = choice["meta_info"]["output_token_logprobs"][:-1]
        if fail == "sentinel_logprob":
            choice["meta_info"]["output_token_logprobs"][0][0] = -9999.0
            if choice.get("logprobs"):
                choice["logprobs"]["content"][0]["logprob"] = -9999.0
        if fail == "no_ids":
            for key in ("prompt_token_ids", "response_token_ids", "meta_info"):
                choice.pop(key, None)
            data.pop("sglext", None)
        return self._json(data)

    async def completions(self, request: web.Request) -> web.Response:
        """``OpenAIServingCompletion`` for one token-id prompt, not streamed."""
        try:
            body, req = await self._read(request, self.p.CompletionRequest)
        except _Reply as reply:
            return reply.response
        fail = self.fail
        await asyncio.sleep(self.delay_s)
        if fail == "internal":
            return self._error(
                "Internal server error: CUDA error: an illegal memory access", "InternalServerError", 500
            )
        if fail == "not_json":
            return web.Response(text="<html>502 Bad Gateway</html>", status=200, content_type="text/html")
        prompt = req.prompt
        if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):  # _validate_request
            return self._error("Prompt cannot be empty")
        if req.stream or req.n != 1 or req.echo or not all(isinstance(t, int) for t in prompt):
            return self._error("contract server: only one token-id prompt, not streamed, is reproduced", "BadRequest")
        prompt_ids = list(prompt)
        if len(prompt_ids) >= self.context_len:  # TokenizerManager._validate_one_request
            return self._error(
                f"The input ({len(prompt_ids)} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)."
            )
        stop = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
        sampling = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            max_tokens=req.max_tokens,
            stop=stop,
            seed=req.seed,
        )
        try:
            completion, text = await asyncio.to_thread(
                self._sample_after, prompt_ids, sampling, req.skip_special_tokens
            )
        except ValueError as exc:
            return self._error(str(exc))
        except PolarError as exc:
            return self._error(exc.message, status=exc.status)
        self.completion_prompts.append(prompt_ids)
        ret = self._ret_item(completion, return_logprob=req.logprobs is not None)
        meta = ret["meta_info"]
        logprobs = None
        if req.logprobs is not None:  # to_openai_style_logprobs over the output triples
            logprobs = self.p.LogProbs(
                text_offset=[-1] * len(meta["output_token_logprobs"]),
                token_logprobs=[lp for lp, _, _ in meta["output_token_logprobs"]],
                tokens=[text for _, _, text in meta["output_token_logprobs"]],
                top_logprobs=[],  # output_top_logprobs only with top_logprobs_num > 0
            )
        finish = meta["finish_reason"]
        choice = self.p.CompletionResponseChoice(
            index=0,
            text=text,
            logprobs=logprobs,
            finish_reason=finish["type"],
            matched_stop=finish.get("matched"),
            token_ids=ret["output_ids"] if req.return_token_ids else None,
            prompt_token_ids=ret["prompt_token_ids"] if req.return_token_ids else None,
        )
        usage = self.p.UsageInfo(
            prompt_tokens=meta["prompt_tokens"],
            completion_tokens=meta["completion_tokens"],
            total_tokens=meta["prompt_tokens"] + meta["completion_tokens"],
        )
        response = self.p.CompletionResponse(
            id=meta["id"],
            model=req.model,
            created=int(time.time()),
            choices=[choice],
            usage=usage,
            metadata={"weight_version": meta["weight_version"]},
        )
        data = response.model_dump()
        if fail == "misaligned":
            data["choices"][0]["logprobs"]["token_logprobs"].pop()
        if fail == "sentinel_logprob":
            data["choices"][0]["logprobs"]["token_logprobs"][0] = -9999.0
        if fail == "no_ids":
            for key in ("prompt_token_ids", "token_ids"):
                data["choices"][0].pop(key, None)
        return self._json(data)

    def _sample_after(
        self, prompt_ids: list[int], sampling: SamplingParams, skip_special_tokens: bool
    ) -> tuple[Any, str]:
        """The completion after exactly ``prompt_ids``, and its text as SGLang detokenizes it."""
        local = self.local
        canonical = CanonicalRequest(api="sglang", model=self.served_model, messages=[], sampling=sampling)
        if isinstance(self.engine, ScriptedEngine):
            completion = self._replay_after(prompt_ids, canonical)
        else:
            completion = local._complete_sync(canonical, prompt_ids)
        with local.lock:
            if skip_special_tokens:
                text = local.decode(list(completion.response_ids))
            else:
                text = "".join(local.token_texts(list(completion.response_ids)))
        if isinstance(completion.matched_stop, str):  # no_stop_trim=False: the stop string is cut from the text
            text = text[: text.find(completion.matched_stop)]
        return completion, text

    def _replay_after(self, prompt_ids: list[int], canonical: CanonicalRequest) -> Completion:
        """The scripted turn due after ``prompt_ids``, as the tokens the chat template writes for it after a generation
        prompt, up to its end-of-turn token: what a model that made this turn samples."""
        engine, local = self.engine, self.local
        assert isinstance(engine, ScriptedEngine)
        with local.lock:
            local.check_context(len(prompt_ids))
            rendered = "".join(local.token_texts(prompt_ids))
            index = rendered.count("<|im_start|>assistant") - 1  # the last one is the generation prompt
            if index < 0 or (index >= len(engine.turns) and not engine.cycle):
                raise ValueError(f"contract server: no scripted turn for a prompt with {index} assistant turns")
            turn = engine.turns[index % len(engine.turns)]
            user = [{"role": "user", "content": "."}]
            head = local.render_ids(user, [], add_generation_prompt=True, enable_thinking=None)
            full = local.render_ids([*user, turn], [], add_generation_prompt=False, enable_thinking=None)
            tail = full[len(head) :]
            end = next(i for i, token in enumerate(tail) if token in local.eos_ids)
            response = tail[: end + 1]
            max_tokens = canonical.sampling.max_tokens
            finish = "stop"
            if max_tokens is not None and len(response) > max_tokens:
                response, finish = response[:max_tokens], "length"
            logprobs = local.score(prompt_ids, response, canonical.sampling.effective_temperature())
        return Completion(
            message=AssistantMessage(),
            finish_reason=finish,
            prompt_ids=prompt_ids,  # type: ignore[arg-type]
            response_ids=response,
            logprobs=logprobs,
            served_model=self.served_model,
            engine=engine.name,
            weight_version=self.weight_version,
        )

    def _ret_item(self, completion: Any, *, return_logprob: bool) -> dict[str, Any]:
        """What TokenizerManager hands serving_chat: text, output_ids, meta_info, prompt_token_ids."""
        n = len(completion.response_ids)
        if completion.finish_reason == "length":
            finish: dict[str, Any] = {"type": "length", "length": n}
        elif completion.matched_stop is not None:
            finish = {"type": "stop", "matched": completion.matched_stop}
        else:
            finish = {"type": "stop", "matched": completion.response_ids[-1]}  # the EOS id it sampled
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(completion.prompt_ids),
            "weight_version": self.weight_version,
            "num_retractions": 0,
        }
        if return_logprob:
            with self.local.lock:  # chat forces return_text_in_logprobs: one decode per id
                texts = self.local.token_texts(completion.response_ids)
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, tid, text]
                for lp, tid, text in zip(completion.logprobs, completion.response_ids, texts, strict=True)
            ]
            meta["output_token_logprobs_length"] = n
        meta.update({"reasoning_tokens": 0, "completion_tokens": n, "cached_tokens": 0})
        return {
            "output_ids": list(completion.response_ids),
            "meta_info": meta,
            "prompt_token_ids": list(completion.prompt_ids),
        }

    def _build_chat_response(self, req: Any, ret: dict[str, Any], completion: Any) -> Any:
        """``OpenAIServingChat._build_chat_response`` for one choice."""
        p = self.p
        meta = ret["meta_info"]
        finish = meta["finish_reason"]
        sglext = None
        input_ids = list(ret["prompt_token_ids"]) if req.return_input_ids_in_sglext else None
        output_ids = [list(ret["output_ids"])] if req.return_output_ids_in_sglext else None
        if input_ids is not None or output_ids is not None:
            sglext = p.SglExt(input_ids=input_ids, output_ids=output_ids)
        logprobs = None
        if req.logprobs:
            logprobs = p.ChoiceLogprobs(
                content=[
                    p.ChatCompletionTokenLogprob(token=text, bytes=list(text.encode()), logprob=lp, top_logprobs=[])
                    for lp, _, text in meta["output_token_logprobs"]
                ]
            )
        message = completion.message
        tool_calls = None
        if message.tool_calls:
            tool_calls = [
                p.ToolCall(id=c.id, index=i, function=p.FunctionResponse(name=c.name, arguments=c.arguments))
                for i, c in enumerate(message.tool_calls)
            ]
            if finish["type"] == "stop":  # _process_tool_calls mutates the shared meta_info dict
                finish["type"] = "tool_calls"
                finish["matched"] = None
        choice = p.ChatCompletionResponseChoice(
            index=0,
            message=p.ChatMessage(
                role="assistant",
                content=message.content or "",
                tool_calls=tool_calls,
                reasoning_content=message.reasoning or None,
            ),
            logprobs=logprobs,
            finish_reason=finish["type"],
            matched_stop=finish.get("matched"),
            prompt_token_ids=ret["prompt_token_ids"] if (req.return_prompt_token_ids or req.return_token_ids) else None,
            response_token_ids=ret["output_ids"] if req.return_token_ids else None,
            meta_info=meta if req.return_meta_info else None,
        )
        usage = p.UsageInfo(
            prompt_tokens=meta["prompt_tokens"],
            completion_tokens=meta["completion_tokens"],
            total_tokens=meta["prompt_tokens"] + meta["completion_tokens"],
            reasoning_tokens=0,
        )
        return p.ChatCompletionResponse(
            id=meta["id"],
            created=int(time.time()),
            model=req.model,
            choices=[choice],
            usage=usage,
            metadata={"weight_version": meta["weight_version"]},
            sglext=sglext,
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body, req = await self._read(request, self.p.TokenizeRequest)
        except _Reply as reply:
            return reply.response
        if req.messages is not None:
            kwargs = req.chat_template_kwargs or {}
            canonical = CanonicalRequest(
                api="sglang", model=req.model, messages=body["messages"], tools=body.get("tools") or [],
                enable_thinking=kwargs.get("enable_thinking"),
            )  # fmt: skip
            with self.local.lock:
                tokens = self.local.prompt_ids(canonical)
            count: Any = len(tokens)
        elif isinstance(req.prompt, str):
            with self.local.lock:
                tokens = self.local.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            count = len(tokens)
        else:
            return self._error(f"Invalid prompt type: {type(req.prompt)}. Expected str or List[str].")
        return self._json(
            self.p.TokenizeResponse(tokens=tokens, count=count, max_model_len=self.context_len).model_dump()
        )

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """http_server.update_weights_from_disk: the body validated as ``UpdateWeightFromDiskReqInput``; in-flight
        requests finish first (SGLang takes its model-update writer lock; here the engine's lock); on success the
        ``weight_version`` given becomes every later answer's ``meta_info.weight_version``."""
        import pydantic

        raw = await request.read()
        try:
            body = orjson.loads(raw)
            self.requests.append(body)
            obj = pydantic.TypeAdapter(self.update_weights_input).validate_python(body)
        except orjson.JSONDecodeError as exc:
            return self._error(f"JSON decode error: {exc}", "Bad Request")
        except pydantic.ValidationError as exc:
            return self._error(f"{exc} {exc.errors()}", "Bad Request")
        self.weight_updates.append(obj)
        if not (Path(obj.model_path) / "config.json").is_file():
            content = {"success": False, "message": f"Failed to get weights iterator: {obj.model_path} not found",
                       "num_paused_requests": 0}  # fmt: skip
            return self._json(content, 400)
        await asyncio.to_thread(self.local.reload, obj.model_path, obj.weight_version)
        message = "Succeeded to update model weights."
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return self._json({"success": True, "message": message, "num_paused_requests": 0})

    async def models(self, request: web.Request) -> web.Response:
        card = self.p.ModelCard(id=self.served_model, root=self.local.model_dir, max_model_len=self.context_len)
        return self._json(self.p.ModelList(data=[card]).model_dump())

    async def model_info(self, request: web.Request) -> web.Response:
        return self._json(
            {
                "model_path": self.local.model_dir,
                "served_model_name": self.served_model,
                "weight_version": self.weight_version,
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)


class _Reply(Exception):
    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response
