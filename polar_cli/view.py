"""One session's reconstruction as a self-contained HTML page (inline CSS and JS, no network).

Each chain is a section: the prompt (collapsed), then its completion turn by turn: sampled turns
with every token colored by its captured logprob, interstitial tokens (loss mask 0) shaded, the
parsed assistant message under each sampled turn (reasoning, text, tool calls) and the messages
an interstitial carries (tool results, user turns). Why a chain started beside the others and why
it was cut are marked where they happen. Hovering a token shows its id, text, logprob and mask.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

import orjson

from polar_addon.call_roles import DEFAULT_TRAINED_ROLES
from polar_addon.capture import CaptureRecord
from polar_cli.build import SessionBuild
from polar_cli.build.prefix_merging import RecordChain
from polar_cli.build.rewards import SessionInfo, decide_reward, untrained_role

_CSS = """
:root { --mask: #d9d9d9; --ink: #1d1d1f; --muted: #6e6e73; --break: #c0392b; }
body { font: 14px/1.45 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: var(--ink); margin: 0 0 4rem; }
header { position: sticky; top: 0; background: #fff; border-bottom: 1px solid #ddd; padding: .6rem 1rem; z-index: 2; }
header h1 { font-size: 1.1rem; margin: 0 0 .3rem; }
.meta span { margin-right: 1.2rem; color: var(--muted); } .meta b { color: var(--ink); }
.legend { margin-top: .3rem; font-size: 12px; color: var(--muted); }
.legend .sw { display: inline-block; width: 2.2rem; height: .8rem; vertical-align: middle; margin: 0 .2rem; }
main { padding: 0 1rem; }
section.chain { border: 1px solid #ccc; border-radius: 6px; margin: 1rem 0; padding: .5rem .8rem; }
section.chain h2 { font-size: 1rem; margin: .2rem 0 .4rem; }
.chain-summary, .call-id { color: var(--muted); font-size: 12px; }
.start { background: #fff6e0; border-left: 4px solid #e0a800; padding: .3rem .6rem; margin: .3rem 0; }
.break { background: #fdecea; border-left: 4px solid var(--break); padding: .3rem .6rem; margin: .5rem 0 .2rem; }
.break b, .start b { font-family: ui-monospace, Menlo, monospace; }
.turn { border-top: 1px dashed #bbb; padding: .3rem 0; }
.turn.sampled { border-top: 2px solid #5b8def; }
.turn-head { font-size: 12px; color: var(--muted); margin-bottom: .2rem; }
.toks { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; white-space: pre-wrap;
        word-break: break-all; }
.t { border-radius: 2px; cursor: default; }
.t.m { background: repeating-linear-gradient(135deg, var(--mask), var(--mask) 3px, #ececec 3px, #ececec 6px);
       color: #555; }
.t:hover { outline: 1px solid #000; }
.ids .t::after { content: " "; }
.msg { margin: .3rem 0 .2rem 1rem; font-size: 13px; }
.msg .role { font-weight: 600; color: #444; }
.msg pre { background: #f6f8fa; border: 1px solid #e1e4e8; padding: .3rem .5rem; margin: .2rem 0; white-space: pre-wrap;
           max-height: 16rem; overflow: auto; }
.tool-call .name { font-family: ui-monospace, Menlo, monospace; font-weight: 600; color: #6a1b9a; }
details.prompt summary { cursor: pointer; color: var(--muted); }
details.prompt pre { white-space: pre-wrap; max-height: 24rem; overflow: auto; background: #fafafa; padding: .4rem; }
#info { position: fixed; bottom: 0; left: 0; right: 0; background: #222; color: #eee;
        font: 12px ui-monospace, monospace; padding: .35rem 1rem; }
.untrainable { color: var(--break); font-weight: 600; }
"""

_JS = """
(function () {
  var info = document.getElementById('info');
  document.addEventListener('mouseover', function (e) {
    var t = e.target.closest('.t');
    if (!t) return;
    var lp = parseFloat(t.dataset.lp);
    info.textContent = 'token ' + t.dataset.id + '  ' + JSON.stringify(t.dataset.text || t.textContent) +
      (t.classList.contains('s')
        ? '  logprob ' + lp.toFixed(4) + '  p=' + Math.exp(lp).toFixed(4) + '  mask 1 (sampled)'
        : '  mask 0 (interstitial, from the next prompt)');
  });
  document.querySelectorAll('section.chain').forEach(function (sec) {
    var sampled = sec.querySelectorAll('.t.s'), masked = sec.querySelectorAll('.t.m'), sum = 0;
    sampled.forEach(function (t) { sum += parseFloat(t.dataset.lp); });
    var out = sec.querySelector('.chain-summary');
    out.dataset.sampled = sampled.length;
    out.dataset.masked = masked.length;
    out.textContent = sampled.length + ' sampled tokens (mean logprob ' +
      (sampled.length ? (sum / sampled.length).toFixed(3) : 'n/a') + '), ' + masked.length + ' interstitial tokens';
  });
  var toggle = document.getElementById('show-ids');
  if (toggle) toggle.addEventListener('change', function () {
    document.querySelectorAll('.toks').forEach(function (el) {
      el.classList.toggle('ids', toggle.checked);
      el.querySelectorAll('.t').forEach(function (t) {
        if (!t.dataset.text) t.dataset.text = t.textContent;
        t.textContent = toggle.checked ? t.dataset.id : t.dataset.text;
      });
    });
  });
  document.body.dataset.ready = '1';
})();
"""


def logprob_color(logprob: float) -> str:
    """Green for a likely token, through yellow, to red for an unlikely one (hue = 120 * p); grey for a
    value that is no log-probability (NaN, infinite), which stores written before capture refused them hold."""
    if not math.isfinite(logprob):
        return "hsl(0,0%,80%)"
    p = math.exp(min(max(logprob, -50.0), 0.0))
    return f"hsl({120 * p:.0f},75%,82%)"


class _Pieces:
    """Display text per token id: the tokenizer's decoding of that one token, or the id."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"{token_id} "
        piece = self._cache.get(token_id)
        if piece is None:
            piece = self.tokenizer.decode([token_id]).replace("\n", "↵\n")
            self._cache[token_id] = piece
        return piece

    def text(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(list(ids))


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _tokens(ids: Sequence[int], logprobs: Sequence[float] | None, pieces: _Pieces) -> str:
    out = []
    for i, token in enumerate(ids):
        text = _esc(pieces(token))
        if logprobs is None:
            out.append(f'<span class="t m" data-id="{token}">{text}</span>')
        else:
            lp = logprobs[i]
            out.append(
                f'<span class="t s" data-id="{token}" data-lp="{lp:.6g}" '
                f'style="background:{logprob_color(lp)}">{text}</span>'
            )
    return "".join(out)


def _pretty_json(text: str) -> str:
    try:
        return orjson.dumps(orjson.loads(text), option=orjson.OPT_INDENT_2).decode()
    except orjson.JSONDecodeError:
        return text


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _sampled_message(record: CaptureRecord) -> str:
    message = record.response_message or {}
    parts = []
    if message.get("reasoning"):
        parts.append(
            f'<div class="reasoning"><span class="role">reasoning</span><pre>{_esc(message["reasoning"])}</pre></div>'
        )
    if message.get("content"):
        parts.append(
            f'<div class="content"><span class="role">assistant</span><pre>{_esc(message["content"])}</pre></div>'
        )
    for call in message.get("tool_calls") or []:
        parts.append(
            '<div class="tool-call"><span class="role">tool call</span> '
            f'<span class="name">{_esc(call.get("name"))}</span>'
            f' <span class="call-id">{_esc(call.get("id", ""))}</span>'
            f"<pre>{_esc(_pretty_json(call.get('arguments', '')))}</pre></div>"
        )
    return f'<div class="msg">{"".join(parts)}</div>' if parts else ""


def _interstitial_messages(prev: CaptureRecord, nxt: CaptureRecord) -> str:
    """The messages the next call added after the previous call's turn: tool results, user turns."""
    added = nxt.messages[len(prev.messages) + 1 :]
    parts = []
    for message in added:
        role = message.get("role", "?")
        label = f"tool result {message.get('tool_call_id', '')}" if role == "tool" else role
        css = "tool-result" if role == "tool" else role
        parts.append(
            f'<div class="{_esc(css)}"><span class="role">{_esc(label)}</span>'
            f"<pre>{_esc(_content_text(message.get('content')))}</pre></div>"
        )
    return f'<div class="msg">{"".join(parts)}</div>' if parts else ""


def _chain_section(chain: RecordChain, session: SessionInfo | None, pieces: _Pieces, role: str) -> str:
    records = chain.records
    merged = chain.merge()
    decision = untrained_role(
        decide_reward(session, records, per_request=False, broadcast=False), role, DEFAULT_TRAINED_ROLES
    )
    trainable = (
        "trainable"
        if decision.trainable
        else f'<span class="untrainable">not trainable ({_esc(decision.reason)})</span>'
    )
    cut = f' data-break="{_esc(chain.end.cause.value)}"' if chain.end else ""
    out = [
        f'<section class="chain" id="chain-{chain.index}" data-chain="{chain.index}" data-calls="{len(records)}"'
        f' data-role="{_esc(role)}"{cut}>',
        (
            f"<h2>Chain {chain.index} · {_esc(role)} · {len(records)} call{'s' * (len(records) != 1)} merged "
            f"(calls {', '.join(str(r.seq) for r in records)}) · reward {decision.reward:g} · {trainable}</h2>"
        ),
        '<div class="chain-summary"></div>',
    ]
    if chain.start is not None:
        related = f" (from chain {chain.related})" if chain.related is not None else ""
        out.append(
            f'<div class="start" data-cause="{_esc(chain.start.cause.value)}">started beside earlier chains{related}: '
            f"<b>{_esc(chain.start.cause.value)}</b>: {_esc(chain.start.detail)}</div>"
        )
    first = records[0]
    out.append(
        f'<details class="prompt"><summary>prompt: {len(first.prompt_ids)} tokens (call {first.seq}, '
        f"{len(first.messages)} messages)</summary><pre>{_esc(pieces.text(first.prompt_ids))}</pre></details>"
    )
    for segment in merged.segments:
        record = records[segment.call]
        ids = merged.completion_ids[segment.start : segment.end]
        if segment.kind == "sampled":
            out.append(
                f'<div class="turn sampled" data-call="{record.seq}">'
                f'<div class="turn-head">call {record.seq} · sampled '
                f"{len(ids)} tokens · finish {_esc(record.finish_reason)} · loss mask 1</div>"
                f'<div class="toks">{_tokens(ids, merged.logprobs[segment.start : segment.end], pieces)}</div>'
                f"{_sampled_message(record)}</div>"
            )
        else:
            out.append(
                f'<div class="turn inter" data-call="{record.seq}">'
                f'<div class="turn-head">interstitial: {len(ids)} tokens '
                f"of call {record.seq}'s prompt · loss mask 0</div>"
                f'<div class="toks">{_tokens(ids, None, pieces)}</div>'
                f"{_interstitial_messages(records[segment.call - 1], record)}</div>"
            )
    if chain.end is not None:
        moved = f"; the conversation continues in chain {chain.continued_by}" if chain.continued_by is not None else ""
        out.append(
            f'<div class="break" data-cause="{_esc(chain.end.cause.value)}">break after call {chain.tip.seq}: '
            f"<b>{_esc(chain.end.cause.value)}</b>: {_esc(chain.end.detail)}{moved}</div>"
        )
    out.append("</section>")
    return "\n".join(out)


def render_session(
    built: SessionBuild,
    records: list[CaptureRecord],
    session: SessionInfo | None,
    *,
    tokenizer: Any | None = None,
) -> str:
    """The HTML page for one built session (``records``: all its calls, failed ones included)."""
    pieces = _Pieces(tokenizer)
    stats = built.stats
    failed = [r for r in records if r.status != "ok"]
    meta = {
        "task": session.task_id if session else None,
        "group": session.group_id if session else None,
        "sample": session.sample_index if session else None,
        "harness": built.harness,
        "status": session.status if session else "no session row",
        "reward": session.reward if session else None,
        "calls": f"{stats.calls} ok, {len(failed)} failed",
        "chains": f"{stats.chains_total} ({stats.chains_truncated} cut)",
        "merge rate": f"{stats.merge_rate:.1%}",
        "re-tokenized merges": stats.retokenized_merges,
        "end-of-turn id": built.eot_token_id,
    }
    meta_html = "".join(f"<span>{_esc(k)} <b>{_esc(v)}</b></span>" for k, v in meta.items() if v is not None)
    legend = (
        '<div class="legend">sampled token, by p = exp(logprob): '
        f'<span class="sw" style="background:{logprob_color(0.0)}"></span>p=1 '
        f'<span class="sw" style="background:{logprob_color(math.log(0.5))}"></span>p=0.5 '
        f'<span class="sw" style="background:{logprob_color(-20)}"></span>p≈0 · '
        '<span class="sw t m"></span>interstitial (loss mask 0) · '
        + (
            '<label><input type="checkbox" id="show-ids"> show token ids</label>'
            if tokenizer is not None
            else "token ids shown (no tokenizer)"
        )
        + "</div>"
    )
    failed_html = "".join(
        f'<div class="break" data-failed="{r.seq}">call {r.seq} failed and is not training data: {_esc(r.error)}</div>'
        for r in failed
    )
    # The build's traces are its chains', in order (prefix merging): each says its chain's role.
    sections = "\n".join(
        _chain_section(chain, session, pieces, trace.role or "agent")
        for chain, trace in zip(built.chains, built.traces)
    )
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>polar trace · {_esc(built.session_id)}</title><style>{_CSS}</style></head>\n<body>"
        f'<header><h1>Session {_esc(built.session_id)}</h1><div class="meta">{meta_html}</div>{legend}</header>\n'
        f"<main>{failed_html}{sections}</main>\n"
        '<div id="info">hover a token to see its id, logprob and loss mask</div>'
        f"<script>{_JS}</script></body></html>\n"
    )
