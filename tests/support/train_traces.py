"""Traces for trainer tests, sampled from the tiny model itself.

Each trace is shaped like a prefix-merged one: ``a1 (sampled, mask 1) | u (interstitial, mask 0)
| a2 (sampled, mask 1)``. The behaviour logprobs are the model's own ``log_softmax(logits / T)``
from one unpadded fp32 forward pass, i.e. what an exact engine would report; so a trainer step
on these traces starts on-policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from polar_cli.trace import Trace


@dataclass
class SessionSpec:
    group_id: str
    session_id: str
    reward: float
    traces: int = 1  # traces the session fans out into (sub-agent, compaction...)
    trainable: bool = True


class TraceFactory:
    def __init__(self, model_dir: Path, temperature: float = 1.0, seed: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.temperature = temperature
        self.generator = torch.Generator().manual_seed(seed)
        self.eot = self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    @torch.no_grad()
    def _logprobs(self, ids: list[int]) -> list[float]:
        """log p(ids[i] | ids[:i]) for i >= 1, at the factory's temperature."""
        logits = self.model(torch.tensor([ids])).logits[0, :-1].float() / self.temperature
        lp = torch.log_softmax(logits, dim=-1)
        return [0.0] + lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()

    @torch.no_grad()
    def _sample(self, ids: list[int], n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            logits = self.model(torch.tensor([ids + out])).logits[0, -1].float() / self.temperature
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=self.generator))
            out.append(token)
            if token == self.eot:
                break
        return out

    def prompt(self, text: str) -> list[int]:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )

    def trace(
        self,
        spec: SessionSpec,
        index: int,
        *,
        prompt_text: str | None = None,
        first: int = 6,
        second: int = 5,
        interstitial: str = "<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n",
    ) -> Trace:
        prompt = self.prompt(prompt_text or f"task {spec.group_id}: count to {index + 3}")
        a1 = self._sample(prompt, first)
        u = self.tokenizer.encode(interstitial, add_special_tokens=False)
        a2 = self._sample(prompt + a1 + u, second)
        completion = a1 + u + a2
        mask = [1] * len(a1) + [0] * len(u) + [1] * len(a2)
        lps = self._logprobs(prompt + completion)[len(prompt) :]
        behavior = [lp if m else 0.0 for lp, m in zip(lps, mask, strict=True)]
        return Trace(
            trace_id=f"{spec.session_id}-t{index}",
            session_id=spec.session_id,
            task_id=spec.group_id,
            group_id=spec.group_id,
            chain_index=index,
            prompt_ids=prompt,
            completion_ids=completion,
            loss_mask=mask,
            behavior_logprobs=behavior,
            reward=spec.reward,
            trainable=spec.trainable,
            temperature=self.temperature,
            calls_merged=2,
        )

    def traces(self, specs: list[SessionSpec]) -> list[Trace]:
        return [self.trace(spec, i) for spec in specs for i in range(spec.traces)]


def two_group_specs() -> list[SessionSpec]:
    """Two tasks x four sessions with mixed rewards; one session fans out into two traces."""
    return [
        SessionSpec("g0", "g0-s0", 1.0, traces=2),
        SessionSpec("g0", "g0-s1", 0.0),
        SessionSpec("g0", "g0-s2", 1.0),
        SessionSpec("g0", "g0-s3", 0.0),
        SessionSpec("g1", "g1-s0", 0.5),
        SessionSpec("g1", "g1-s1", 0.0),
        SessionSpec("g1", "g1-s2", 1.0),
        SessionSpec("g1", "g1-s3", 0.25),
    ]
