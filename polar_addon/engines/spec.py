"""The engine spec ``KIND:TARGET?KEY=VALUE&...`` (a ``polar_engine`` entry), parsed in this one place.

``sglang:http://gpu1:30000?weight_version=3``, ``vllm:http://127.0.0.1:8000``, ``local:models/tiny?max_len=64``,
``scripted:run.json``. The kind ends at the first ``:`` and the options start at the first ``?``, so a URL target
keeps its own colons; a target cannot carry a query of its own (its ``?`` would start polar's options). Values are
taken as written (no percent-decoding): they are versions and lengths, never free text.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# The options each kind takes. weight_version tags the calls whose answer carries none (vLLM never reports one on
# its OpenAI endpoints; SGLang does once given one); versions=spans samples vLLM on its scale-out endpoints, which
# report the version of every sampled token (engines.vllm); model names the model vLLM is asked for (a LoRA adapter
# it serves beside its base: ``polar engine serve --push adapter``), instead of the first its /v1/models lists;
# max_len shrinks a local model's window (long sessions).
OPTIONS: dict[str, tuple[str, ...]] = {
    "sglang": ("weight_version",),
    "vllm": ("weight_version", "versions", "model"),
    "local": ("max_len", "weight_version"),
    "scripted": (),
}
SHAPE = "KIND:TARGET (sglang:URL, vllm:URL, local:MODEL_DIR)"


@dataclass(frozen=True)
class EngineSpec:
    kind: str  # a key of OPTIONS
    target: str  # the server's URL, the model directory or the script, without the options
    params: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> EngineSpec:
        """``spec`` as an EngineSpec; ValueError naming ``spec`` and what is wrong with it."""
        text = spec.strip()
        kind, colon, rest = text.partition(":")
        if not kind or not colon or not rest:
            raise ValueError(f"engine spec {spec!r} must look like {SHAPE}")
        if kind not in OPTIONS:
            raise ValueError(f"unknown engine kind {kind!r} in {spec!r}: use {', '.join(OPTIONS)}")
        target, _, query = rest.partition("?")
        if not target:
            raise ValueError(f"engine spec {spec!r} has an empty target: it must look like {SHAPE}")
        params: dict[str, str] = {}
        for part in query.split("&"):
            if not part:
                continue
            key, equals, value = part.partition("=")
            if not key or not equals:
                raise ValueError(f"engine spec {spec!r}: option {part!r} must look like KEY=VALUE")
            if key in params:
                raise ValueError(f"engine spec {spec!r}: option {key!r} is given twice")
            params[key] = value
        allowed = OPTIONS[kind]
        unknown = set(params) - set(allowed)
        if unknown:
            takes = f"takes {', '.join(allowed)}" if allowed else "takes no options"
            raise ValueError(f"engine spec {spec!r}: unknown option(s) {sorted(unknown)} ({kind} {takes})")
        if params.get("versions", "spans") != "spans":
            raise ValueError(f"engine spec {spec!r}: versions can only be 'spans' (per-token weight versions)")
        max_len = params.get("max_len")
        if max_len is not None and not max_len.isdigit():
            raise ValueError(f"engine spec {spec!r}: max_len must be a whole number of tokens, not {max_len!r}")
        return cls(kind, target, params)

    @classmethod
    def parse_list(cls, specs: str) -> list[EngineSpec]:
        """The comma-separated specs of one ``polar_engine`` value (a target cannot hold a comma)."""
        return [cls.parse(one) for one in specs.split(",") if one.strip()]

    @property
    def weight_version(self) -> str | None:
        """The policy version to tag the calls with when the engine reports none."""
        return self.params.get("weight_version")

    @property
    def token_versions(self) -> bool:
        """Sample where the engine reports each token's weight version (``versions=spans``)."""
        return self.params.get("versions") == "spans"

    @property
    def model(self) -> str | None:
        """The served model (or adapter) name to request; None: the first the server lists."""
        return self.params.get("model") or None

    @property
    def max_len(self) -> int:
        """The window a local engine serves (0: the model's own)."""
        return int(self.params.get("max_len") or 0)

    def with_params(self, **params: str | None) -> EngineSpec:
        """This spec with ``params`` set (a None value drops that option)."""
        merged = {**self.params, **params}
        return replace(self, params={k: v for k, v in merged.items() if v is not None})

    def __str__(self) -> str:
        query = "&".join(f"{key}={value}" for key, value in self.params.items())
        return f"{self.kind}:{self.target}" + (f"?{query}" if query else "")
