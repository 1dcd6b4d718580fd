"""Mutation score of each core module: how many small deliberate bugs its own fast tests catch.

Each module is mutated with mutmut (operators flipped, constants changed, calls dropped...) and only
the unit test files mapped to it are run against every mutant. A module is worked on in its own
scratch copy of the repository (``.mutation/<module>/``), so runs never touch the working tree and
modules can be re-run one at a time. Prints killed / mutants per module; survivors are listed in
``.mutation/<module>/survivors.txt`` (``mutmut show NAME`` in that directory shows the diff).

    .venv/bin/python bench/mutation.py                 # every module (tens of minutes on 2 cores)
    .venv/bin/python bench/mutation.py identity gateway  # some modules
    .venv/bin/python bench/mutation.py --report        # print the table of what has been run
    .venv/bin/python bench/mutation.py --resume gateway  # take an interrupted run up where it stopped
    .venv/bin/python bench/mutation.py --verify-timeouts --verify-jobs 6 --verify-limit 120 store.trace_store
    .venv/bin/python bench/mutation.py --slowest 1260 providers.openai_responses  # only the slowest-to-test end
    # only some functions' mutants (module first: --only takes every word after it)
    .venv/bin/python bench/mutation.py store.trace_store --only '*final_status*'

Mutants are CPU work: the runs are niceness 10 (``POLAR_MUTATION_NICE``); ``--lock FILE`` holds an flock around each
module.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".mutation"
MUTMUT = Path(sys.executable).with_name("mutmut")
# Mutant runs are CPU work on a machine shared with other engineers' tests: niceness 10 (absolute; the team's
# rule for long pure-CPU jobs). 19 starved them behind every other process under load (a mutant took minutes).
NICE = max(0, int(os.environ.get("POLAR_MUTATION_NICE", "10")) - os.nice(0))
NOT_SLOW = ["-k", "not sigkill and not disk_full"]  # process-kill and tmpfs tests: minutes, not seconds

PROVIDER_TESTS = [
    f"tests/test_provider_{name}.py" for name in ("anthropic_messages", "openai_chat", "openai_responses", "gemini")
]

REWARD_FLOW_UNITS = [
    "tests/test_reward_flow.py::test_a_reward_completes_a_running_session_unless_a_status_said_otherwise",
    "tests/test_reward_flow.py::test_an_error_status_is_never_overwritten_by_a_later_status",
]
STORE_REWARD_UNITS = ["tests/test_store_rewards_sessions_units.py", *REWARD_FLOW_UNITS]

# engines.openai_compat's selection, and its answer builders' (with the think-split tests).
OPENAI_COMPAT_UNITS = [
    "tests/test_engine_sglang.py",
    "tests/test_engine_http_pool.py",
    "tests/test_engine_http_client.py",
    "tests/test_engine_prompt_fast_path.py",
    "tests/test_gateway_sampling.py",
    "tests/test_vllm_token_versions.py",
]
OPENAI_COMPAT_ANSWERS = [
    *OPENAI_COMPAT_UNITS,
    "tests/test_engine_chat_think_split.py",
    "tests/test_engine_openai_compat_audit_units.py",
]

# module -> (files to mutate, pytest selection: its fast unit tests)

MODULES: dict[str, tuple[list[str], list[str]]] = {
    # One entry per provider: each is mutated against its own test file (and the fidelity round trips).
    "providers.anthropic_messages": (
        ["polar_addon/providers/anthropic_messages.py"],
        ["tests/test_provider_anthropic_messages.py", "tests/test_fidelity.py"],
    ),
    "providers.openai_chat": (
        ["polar_addon/providers/openai_chat.py"],
        ["tests/test_provider_openai_chat.py", "tests/test_fidelity.py"],
    ),
    "providers.openai_responses": (
        ["polar_addon/providers/openai_responses.py"],
        ["tests/test_provider_openai_responses.py", "tests/test_fidelity.py"],
    ),
    "providers.gemini": (
        ["polar_addon/providers/gemini.py"],
        ["tests/test_provider_gemini.py", "tests/test_fidelity.py"],
    ),
    "providers.common": (
        ["polar_addon/providers/common.py", "polar_addon/providers/__init__.py"],
        ["tests/test_provider_common.py", *PROVIDER_TESTS, "tests/test_fidelity.py"],
    ),
    "identity": (
        ["polar_addon/identity.py"],
        [
            "tests/test_identity.py",
            "tests/test_identity_audit_units.py",
            "tests/security/test_sessions.py::test_registry_lookup_revoke_end_and_forget",
            "tests/security/test_sessions.py::test_registered_resolution_takes_labels_from_the_registration_alone",
            "tests/security/test_sessions.py::test_claimed_mode_trusts_claims_but_never_takes_a_secret_for_a_session_id",
        ],
    ),
    # The reward-file reading and Harbor's rule (the rollouts that attack them are too slow per mutant).
    "rollout.verify": (
        ["polar_cli/rollout/verify.py"],
        [
            "tests/test_rollout_tasks.py",
            "tests/test_rollout_verify.py",
            *(
                f"tests/security/test_verifier.py::{name}"
                for name in (
                    "test_reward_json_takes_numbers_only",
                    "test_reward_json_counts_only_when_the_tests_write_it",
                    "test_reading_a_reward_file_follows_no_link_and_is_bounded",
                    "test_the_guard_verdict_is_its_last_line",
                )
            ),
        ],
    ),
    # Each verifier strategy's decision, on canned results (run with --only '*decide*' '*rewards*': the rest runs
    # only inside rollouts).
    "rollout.verifiers": (
        ["polar_cli/rollout/verifiers.py"],
        ["tests/test_rollout_session.py", "-k", "not session_runner"],
    ),
    # The patch bound and the host-side git (no rollout: the runner's own functions on a planted workspace).
    "rollout.workspace": (
        ["polar_cli/rollout/workspace.py"],
        [
            "tests/security/test_workspace_attacks.py",
            "tests/test_rollout_workspace_template.py",  # prepare_template on tiny local clones and Dockerfiles
            "-k",
            "not rollout_scores",
        ],
    ),
    # The policy loss, the chunked loss and its metrics, the step's sampling, split and chunks, the starting weights'
    # table, resume and TRL's arguments, on a trainer made without TRL's set-up (run with --only on every function but
    # TraceGRPOTrainer.__init__: the patterns are in bench/mutation_report.md).
    "train.trainer": (
        ["polar_cli/train/trainer.py"],
        ["tests/test_train_loss_value.py", "tests/test_train_trainer_units.py"],
    ),
    "gateway": (
        ["polar_addon/gateway.py"],
        [
            "tests/test_gateway_units.py",
            "tests/test_gateway_audit_units.py",
            "tests/test_gateway_core.py",
            "tests/test_gateway_rest_units.py",
        ],
    ),
    "store.journal": (
        ["polar_addon/store/journal.py"],
        [
            "tests/test_store_journal.py",
            "tests/test_store_journal_audit_units.py",
            "tests/test_store_crash.py",
            *NOT_SLOW,
        ],
    ),
    "store.compaction": (
        ["polar_addon/store/compaction.py"],
        ["tests/test_store_compaction.py", "tests/test_store_basic.py", "tests/test_store_crash.py", *NOT_SLOW],
    ),
    "store.trace_store": (
        ["polar_addon/store/trace_store.py"],
        [
            "tests/test_store_trace_store.py",
            "tests/test_store_basic.py",
            "tests/test_store_crash.py",
            "tests/test_store_quarantine.py",
            "tests/test_store_durability_audit_units.py",
            "tests/test_store_trace_store_rest_units.py",
            # test_store_faults.py runs its stores in child processes, the read-only one as
            # `nobody`, who cannot load mutmut's trampoline: both are left out.
            *NOT_SLOW,
        ],
    ),
    "build.prefix_merging": (
        ["polar_cli/build/prefix_merging.py"],
        ["tests/test_build_chains.py", "tests/test_build_prefix_merging.py"],
    ),
    "build.breaks": (
        ["polar_cli/build/breaks.py"],
        ["tests/test_build_breaks.py", "tests/test_build_breaks_audit_units.py", "tests/test_build_prefix_merging.py"],
    ),
    "build.rewards": (["polar_cli/build/rewards.py"], ["tests/test_build_rewards.py"]),
    "train.advantages": (["polar_cli/train/advantages.py"], ["tests/test_train_advantages.py"]),
    "train.dataset": (
        ["polar_cli/train/dataset.py"],
        ["tests/test_train_dataset.py", "tests/test_train_dataset_audit_units.py"],
    ),
    "train.config": (
        ["polar_cli/train/config.py"],
        ["tests/test_train_config.py", "tests/test_train_config_audit_units.py"],
    ),
    # Tool-call parsing of the sampled text (what becomes a call, what stays content).
    "tool_parsers.hermes": (["polar_addon/tool_parsers/hermes.py"], ["tests/test_tool_parsers_hermes.py"]),
    "tool_parsers.qwen3_coder": (
        ["polar_addon/tool_parsers/qwen3_coder.py"],
        ["tests/test_tool_parsers_qwen3_coder.py", "tests/test_tool_parsers_qwen3_coder_edges.py"],
    ),
    # Does a call continue its session's previous one, message for message (the token-continuity decision).
    "continuity.check": (
        ["polar_addon/continuity/check.py"],
        [
            "tests/test_continuity.py",
            "tests/test_continuity_providers.py",
            "tests/test_continuity_check_edges.py",
            "tests/test_continuity_fast_paths.py",
        ],
    ),
    # The session's stage decisions (deadline, early stop, statuses, rewards) on the local runtime and a real proxy
    # (run with --only on the decision functions: the rest is the same code the rollouts run).
    "rollout.session": (["polar_cli/rollout/session.py"], ["tests/test_rollout_session_decisions.py"]),
    "rollout.tasks": (
        ["polar_cli/rollout/tasks.py"],
        ["tests/test_rollout_tasks.py", "tests/test_rollout_tasks_units.py"],
    ),
    # What a call is for (agent, auxiliary side job, discarded): decides which calls a policy is trained on.
    "call_roles": (["polar_addon/call_roles.py"], ["tests/test_call_roles.py"]),
    # What an evaluation reports (issue 24): pass@k and its SE, each session's cause, the per-call counts.
    "eval.metrics": (["polar_cli/eval/metrics.py"], ["tests/test_eval_metrics.py"]),
    "eval.report": (["polar_cli/eval/report.py"], ["tests/test_eval_metrics.py"]),
    "build.roles": (["polar_cli/build/roles.py"], ["tests/test_call_roles.py", "tests/test_build_prefix_merging.py"]),
    # What TRL's async trainer is fed (issue 27): the sample layout and versions, the pushed checkpoints (the
    # end-to-end training runs are left out: minutes per mutant).
    "trl_async.samples": (["polar_cli/trl_async/samples.py"], ["tests/test_trl_async.py", "-k", "not end_to_end"]),
    # The loop's decisions: rewards and their rise, the state file, the policy, the train command, backfill (run with
    # --only on those: the rest runs loops).
    "rollout.loop": (
        ["polar_cli/rollout/loop.py"],
        [
            "tests/test_loop_units.py",
            "tests/test_loop_backfill.py::test_a_group_informs_only_with_two_rewarded_sessions_that_differ",
        ],
    ),
    "trl_async.weights": (["polar_cli/trl_async/weights.py"], ["tests/test_trl_async.py", "-k", "not end_to_end"]),
    # Ninth round (issue 29): modules that decide data and rewards, never measured before.
    # Issue 26's adapter push: which checkpoints a server of adapters loads, the requests of a push, the restart
    # that keeps the base (run with --only on max_lora_rank, adapter_refusal, _without_lora_modules, the push
    # functions and ManagedServer's spec), and what each loop training starts from (lora_rank, train_start).
    "serving.adapter": (
        ["polar_cli/serving.py"],
        ["tests/test_serving_units.py", "tests/test_serving_adapter_units.py"],
    ),
    "rollout.loop.adapter": (
        ["polar_cli/rollout/loop.py"],
        ["tests/test_loop_adapter_units.py", "tests/test_loop_units.py"],
    ),
    # The adapter polar train saves beside the merged weights and the one --lora-init goes on from (run with --only
    # on save_adapter and load_adapter: real short trainings on the tiny model, ~30 s a mutant).
    "train.run.adapter": (
        ["polar_cli/train/run.py"],
        ["tests/test_train_lora_adapter.py", "tests/test_train_run_units.py"],
    ),
    # The loop's engine across iterations (_Engine: start, push, adapters, versions, the served-model check) and its
    # held-out eval (_evaluate) on fake serving calls and rollouts (run with --only '*xǁ_Engineǁ*' '*x__evaluate__*'
    # '*x_served_root__*': the rest is measured by rollout.loop and rollout.loop.orchestration).
    "rollout.loop.engine_eval": (
        ["polar_cli/rollout/loop.py"],
        ["tests/test_loop_engine_eval_units.py", "tests/test_loop_units.py"],
    ),
    # engines.openai_compat's rest (run with --only on at_least, ParsedChat.to_completion, and what changed since the
    # halves were run: HTTPEngine.complete, complete_prompt_ids, parse_completion_response, parse_generate_response).
    "engines.openai_compat.rest": (
        ["polar_addon/engines/openai_compat.py"],
        [*OPENAI_COMPAT_ANSWERS, "tests/test_engines_vllm_units.py", "tests/test_engine_openai_compat_rest_units.py"],
    ),
    # The synchronous loop's orchestration (_run_loop: iteration order, which shards and policy each training gets,
    # versions, pushes, nothing_to_train, backfill rounds, resume, refusals, loop.json) on fake rollouts, `polar
    # train` and engine (run with --only on _run_loop, run_loop, _rollout, _backfill, run_train, _policy: _Engine and
    # _evaluate are the fakes' seams, exercised by the slow loop tests).
    "rollout.loop.orchestration": (
        ["polar_cli/rollout/loop.py"],
        [
            "tests/test_loop_orchestration_units.py",
            "tests/test_loop_units.py",
            "tests/test_loop_backfill.py::test_a_group_informs_only_with_two_rewarded_sessions_that_differ",
        ],
    ),
    # The async loop's scheduler (_AsyncLoop: which batch each step trains, the staleness bound, AHEAD, the drains'
    # pushes, the measuring batch, loop.json, resume) on fake rollouts, trainings and engine (run with --only
    # '*_AsyncLoop*': _round and _train are the fakes' seams, exercised by test_async_loop.py).
    "rollout.async_loop.scheduler": (
        ["polar_cli/rollout/async_loop.py"],
        [
            "tests/test_async_loop_scheduler_units.py",
            "tests/test_async_loop_units.py",
            "tests/test_async_loop_keep_units.py",
        ],
    ),
    # The trace store's durability=write (a sync thread behind the appends; run with --only on _sync_loop, _seal,
    # close): store.trace_store's selection and its in-process tests (the SIGKILL test runs it in a child).
    "store.trace_store.durability": (
        ["polar_addon/store/trace_store.py"],
        [
            "tests/test_store_trace_store.py",
            "tests/test_store_basic.py",
            "tests/test_store_crash.py",
            "tests/test_store_quarantine.py",
            "tests/test_store_durability_audit_units.py",
            "tests/test_store_trace_store_rest_units.py",
            *NOT_SLOW,
        ],
    ),
    # engines.openai_compat's answer builders since the tenth round (run with --only on split_think, _sampled,
    # text_completion, _completion, chat_completion, parse_text): the entry's selection and the think-split tests.
    "engines.openai_compat.answers": (["polar_addon/engines/openai_compat.py"], OPENAI_COMPAT_ANSWERS),
    # store.reader's copied-shard rule (each call and reward read once; run with --only on iter_records, once_each,
    # read_rewards, read_sessions): the eleventh round's selection and the tests that came with the rule.
    "store.reader.copies": (
        ["polar_addon/store/reader.py"],
        [
            "tests/test_store_reader_units.py",
            "tests/test_store_basic.py",
            "tests/test_store_pending.py",
            "tests/test_store_cli.py",
            "tests/test_store_copied_shard.py",
            "tests/test_store_reader_audit_units.py",
            "-k",
            "not train_on_a_path",
        ],
    ),
    # The whole of verifiers.py (the entry above runs only decide/rewards): each strategy's layout, what it clears
    # before the verify command and brings out after, on a recording fake sandbox.
    "rollout.verifiers.all": (
        ["polar_cli/rollout/verifiers.py"],
        ["tests/test_rollout_session.py", "tests/test_rollout_verifiers_audit_units.py", "-k", "not session_runner"],
    ),
    # The CLI's helpers: settings declared once (the generated parameters, the flag a refusal names, the redacted
    # manifest), `--set` items, the STORE argument, terminal-safe text, mitmdump's command line and process handling
    # (fake processes), the view page (stand-in records and chains), the tiny model's build (stand-in torch).
    "settings": (
        ["polar_cli/settings.py"],
        [
            "tests/test_cli_helpers_units.py",
            "tests/test_settings.py::test_a_settings_dataclass_round_trips_through_its_command",
            "tests/test_settings.py::test_types_bounds_and_validate_are_usage_errors_naming_the_flag",
            "tests/test_settings.py::test_help_shows_each_option_once_with_its_default_and_help",
            "tests/test_settings.py::test_a_reused_field_keeps_flags_and_help_unless_changed",
        ],
    ),
    "set_option": (
        ["polar_cli/set_option.py"],
        ["tests/test_cli_helpers_units.py", "tests/test_rollout_config_units.py"],
    ),
    "store_arg": (["polar_cli/store_arg.py"], ["tests/test_cli_helpers_units.py"]),
    "terminal": (
        ["polar_cli/terminal.py"],
        ["tests/test_cli_helpers_units.py", "tests/test_store_hostile_rows.py::test_printable_and_markup_safe"],
    ),
    "mitm": (["polar_cli/mitm.py"], ["tests/test_cli_helpers_units.py"]),
    "view": (
        ["polar_cli/view.py"],
        ["tests/test_cli_helpers_units.py", "tests/test_view.py", "-k", "not chromium"],
    ),
    "tiny_model": (["polar_cli/tiny_model.py"], ["tests/test_cli_helpers_units.py"]),
    # The entry mitmproxy loads (addon.py: module-level, no mutant of its own) and the addon set it is made of: which
    # addons, in which hook order, sharing one object.
    "addon": (
        ["polar_addon/addon.py", "polar_addon/addons/__init__.py"],
        # (test_addon_options.py reads the set addon.py made at import, which mutmut cannot see: it runs once)
        ["tests/test_addon_entry_units.py", "tests/test_addon_options.py"],
    ),
    # `--runtime NAME`: which runtimes exist, the name's spelling, the refusals, and that make gives a Runtime.
    "rollout.runtimes": (
        ["polar_cli/rollout/runtimes/__init__.py"],
        ["tests/test_package_inits_units.py", "tests/test_rollout_tasks.py::test_registries_name_what_exists"],
    ),
    # The other npm CLIs' presets (twelfth round, group B): opencode and its kilocode fork, cline, continue; where the
    # CLIs are found and the config writer (test_presets_npm.py imports test_rollout_presets: examples/ at import).
    "harnesses.npm_presets_b": (
        [
            "polar_cli/rollout/harnesses/opencode.py",
            "polar_cli/rollout/harnesses/kilocode.py",
            "polar_cli/rollout/harnesses/cline.py",
            "polar_cli/rollout/harnesses/continue_cli.py",
            "polar_cli/rollout/harnesses/_install.py",
            "polar_cli/rollout/harnesses/_files.py",
        ],
        ["tests/test_harnesses_b_units.py"],
    ),
    # The Python harnesses' presets (twelfth round, group B): each venv harness's argv, env and config files, and the
    # shared venv / bundled-script helpers. test_presets_python.py's unit tests import test_rollout_presets, which
    # reads examples/ at import (the scratch copy has none).
    "harnesses.python_presets": (
        [
            "polar_cli/rollout/harnesses/aider.py",
            "polar_cli/rollout/harnesses/gptme.py",
            "polar_cli/rollout/harnesses/kimi_cli.py",
            "polar_cli/rollout/harnesses/mini_swe_agent.py",
            "polar_cli/rollout/harnesses/openai_agents.py",
            "polar_cli/rollout/harnesses/smolagents.py",
            "polar_cli/rollout/harnesses/openhands.py",
            "polar_cli/rollout/harnesses/_bundled.py",
            "polar_cli/rollout/harnesses/_venv.py",
        ],
        ["tests/test_harnesses_b_units.py"],
    ),
    # vLLM's client: render -> generate -> derender with per-token weight versions, token input, /tokenize counts.
    "engines.vllm": (
        ["polar_addon/engines/vllm.py"],
        ["tests/test_engines_vllm_units.py", "tests/test_vllm_token_versions.py", "tests/test_engine_http_client.py"],
    ),
    # SGLang's client: the token-id extras asked for, token input, /v1/tokenize counts and in-place weight loads.
    "engines.sglang": (
        ["polar_addon/engines/sglang.py"],
        ["tests/test_engines_sglang_units.py", "tests/test_engine_sglang.py"],
    ),
    # The scripted test engine: which turn answers, its tokens scored after the prompt, a cut turn parsed, on a
    # stand-in tokenizer and template (test_engine_scripted.py loads the tiny model: over 10 s a mutant, left out).
    "engines.scripted": (["polar_addon/engines/scripted.py"], ["tests/test_engines_scripted_units.py"]),
    # Engines built from specs (kind, target, version, per-token versions) and the pool's session routing and faults.
    "engines.init": (
        ["polar_addon/engines/__init__.py"],
        [
            "tests/test_engines_init_units.py",
            "tests/test_engine_spec.py",
            "tests/test_engine_affinity.py",
            "tests/test_vllm_token_versions.py",
        ],
    ),
    # Which harness a capture names: the User-Agent, or the system prompt's harness with the SDK's agent after it.
    "harness_id": (["polar_addon/harness_id.py"], ["tests/test_harness_id_units.py", "tests/test_harness_id.py"]),
    # Importing a GGUF checkpoint: the parts, their hashes and refusals, the conversion's calls (on a stand-in
    # transformers), the provenance record, the all-or-nothing move (the real conversion test loads torch: left out).
    "gguf_import": (
        [
            "polar_cli/gguf_import/parts.py",
            "polar_cli/gguf_import/convert.py",
            "polar_cli/gguf_import/importer.py",
            "polar_cli/gguf_import/provenance.py",
        ],
        ["tests/test_gguf_import_units.py", "tests/test_gguf_import.py", "-k", "not real_gguf"],
    ),
    # polar-untrusted's Landlock shim (the verifier's confinement of the code under test, the agent's): its options,
    # the denied directories made and resolved, the rules along their ancestors, the ruleset's syscalls, the refusals
    # (its subprocess tests run the shim under the system python3, which cannot load mutmut's trampoline: left out).
    "rollout.runtimes.untrusted_shim": (
        ["polar_cli/rollout/runtimes/untrusted/polar_untrusted.py"],
        [
            "tests/security/test_untrusted_shim_units.py",
            "tests/security/test_verifier.py::test_polar_untrusted_handles_every_right_of_the_abi",
        ],
    ),
    # Twelfth round: TRL's rollout worker (a batch's records, the metrics it sends, the wait for a versioned
    # checkpoint, health, backpressure: on fake rollouts, no engine) and the CPU stand-in for TRL's varlen kernel.
    "trl_async.worker": (["polar_cli/trl_async/worker.py"], ["tests/test_trl_async_worker_units.py"]),
    "trl_async.cpu_attention": (
        ["polar_cli/trl_async/cpu_attention.py"],
        ["tests/test_trl_async.py", "tests/test_trl_async_worker_units.py", "-k", "cpu_varlen or attention"],
    ),
    # The live dashboard: what it counts and shows of a loop, rollout or store, and what its server serves (the
    # browser run and the CLI's host check are left out).
    "dashboard.snapshot": (
        ["polar_cli/dashboard/snapshot.py"],
        ["tests/test_dashboard.py", "tests/test_dashboard_units.py", "-k", "not live_page and not loopback"],
    ),
    "dashboard.server": (
        ["polar_cli/dashboard/server.py"],
        ["tests/test_dashboard.py", "tests/test_dashboard_units.py", "-k", "not live_page and not loopback"],
    ),
    # The metrics sent to trackers (--report-to parsing, the loop's points), and the training and loop curves (the
    # runs that log through real trackers are left out).
    "trackers": (
        ["polar_cli/trackers.py"],
        [
            "tests/test_trackers.py",
            "tests/test_trackers_units.py",
            "-k",
            "not tensorboard_wandb and not async_loop and not refuses_an_unknown",
        ],
    ),
    "train.plots": (
        ["polar_cli/train/plots.py"],
        [
            "tests/test_train_plots_units.py",
            "tests/test_loop_eval.py::test_a_loop_entry_holds_pass_at_k_its_se_and_the_causes",
        ],
    ),
    # The presets' shared parts (twelfth round): the session's credential forms, config writing, where CLIs and venvs
    # are found, the bundled agents' argv, and how --harness names a preset.
    "harnesses.base": (
        [
            "polar_cli/rollout/harnesses/base.py",
            "polar_cli/rollout/harnesses/_files.py",
            "polar_cli/rollout/harnesses/_install.py",
            "polar_cli/rollout/harnesses/_venv.py",
            "polar_cli/rollout/harnesses/_bundled.py",
            "polar_cli/rollout/harnesses/__init__.py",
        ],
        # tests/test_presets_python.py and test_rollout_presets.py read examples/ on import: not in the scratch copy.
        ["tests/test_harnesses_a_units.py", "tests/test_rollout_command_preset.py", "tests/test_harness_toml_units.py"],
    ),
    # cmd: (twelfth round): the shell line's placeholders, the env that points any client at polar, the host paths.
    "harnesses.command": (
        ["polar_cli/rollout/harnesses/command.py"],
        ["tests/test_harness_command_units.py", "tests/test_rollout_command_preset.py"],
    ),
    # The five npm CLIs' presets (twelfth round): the env names, config keys and argv each harness reads.
    "harnesses.npm_presets": (
        [
            "polar_cli/rollout/harnesses/claude_code.py",
            "polar_cli/rollout/harnesses/codex.py",
            "polar_cli/rollout/harnesses/qwen_code.py",
            "polar_cli/rollout/harnesses/pi.py",
            "polar_cli/rollout/harnesses/gemini_cli.py",
        ],
        ["tests/test_harnesses_a_units.py"],
    ),
    # Children that die with polar however it dies: the lines sent to the guardian, and the guardian itself.
    "lifeline": (["polar_cli/lifeline.py"], ["tests/test_lifeline_units.py"]),
    # The loop's CPU sets: the list syntax, the refusal of CPUs this process may not use, the affinity given back.
    "rollout.cpus": (["polar_cli/rollout/cpus.py"], ["tests/test_cpus_units.py", "tests/test_loop_cpus.py"]),
    # The policy's engine servers: vLLM's argv, the state files, the root cause of a failed start, and how a push
    # reaches a running server (in place, in place keeping requests, or restarted), against fake servers and fake
    # processes (run with --only: vllm_python only finds the repo's vLLM venv).
    "serving": (
        ["polar_cli/serving.py"],
        [
            "tests/test_serving_units.py",
            "tests/test_engine_cli.py::test_root_cause_is_the_first_real_error_not_the_tail",
            "tests/test_engine_cli.py::test_serve_starts_vllm_with_the_flags_polar_needs",
            "tests/test_engine_cli.py::test_reload_of_an_engine_polar_did_not_start_says_what_to_do",
            "tests/test_engine_cli.py::test_stop_twice_says_it_is_already_stopped",
        ],
    ),
    # Which captured data reaches training: shard files and their schemas, journal entries, the reader (shards plus
    # the journal's unsealed rows), the validator's findings (the store tests' subprocess kills and the train CLI
    # test are left out: seconds each per mutant).
    "store.shards": (
        ["polar_addon/store/shards.py"],
        [
            "tests/test_store_shards_units.py",
            "tests/test_store_basic.py",
            "tests/test_store_trace_store.py",
            "tests/test_store_quarantine.py",
        ],
    ),
    "store.entries": (
        ["polar_addon/store/entries.py"],
        [
            "tests/test_store_entries_units.py",
            "tests/test_store_basic.py",
            "tests/test_store_quarantine.py",
            "tests/test_store_compaction.py",
        ],
    ),
    "store.reader": (
        ["polar_addon/store/reader.py"],
        [
            "tests/test_store_reader_units.py",
            "tests/test_store_basic.py",
            "tests/test_store_pending.py",
            "tests/test_store_cli.py",
            "-k",
            "not train_on_a_path",
        ],
    ),
    "store.validate": (
        ["polar_addon/store/validate.py"],
        [
            "tests/test_store_validate_units.py",
            "tests/test_store_copied_shard.py",
            "tests/test_store_cli.py",
            "tests/test_store_hostile_rows.py",
            "tests/test_store_quarantine.py",
            "tests/test_store_pending.py",
            "-k",
            "not train_on_a_path",
        ],
    ),
    "store.pending": (
        ["polar_addon/store/pending.py"],
        [
            "tests/test_store_pending_units.py",
            "tests/test_store_pending.py",
            "tests/test_store_basic.py",
            "tests/test_store_cli.py",
            "-k",
            "not train_on_a_path",
        ],
    ),
    # One rollout's settings: `polar rollout`'s refusals before anything runs, and the runner's config made of them.
    "rollout.config": (
        ["polar_cli/rollout/config.py"],
        ["tests/test_rollout_config_units.py", "tests/test_settings.py"],
    ),
    # The embedded CPU engine's sampling (the logprobs recorded, how a turn ends, top-k/top-p/min-p, the window, the
    # request checks) on a scripted stand-in for the model: test_engine_local.py loads the tiny model (~5 s cold in
    # each mutant's process, so most of its mutants time out). Run with --only on the logic; the rest is glue.
    "engines.local": (
        ["polar_addon/engines/local.py"],
        ["tests/test_engines_local_units.py", "tests/test_rollout_window_redact.py"],
    ),
    # The exports other tools train on (ATIF trajectories, OpenAI chat JSONL): each message once, in order, with
    # its role, tool calls and the sampled turn's exact tokens (test_export.py's store tests: seconds; its every-API
    # test runs a gateway).
    "export.atif": (
        ["polar_cli/export/atif.py"],
        [
            "tests/test_export_units.py",
            "tests/test_export.py",
            "tests/test_call_roles.py",
            "-k",
            "export and not every_api_dialects",
        ],
    ),
    "export.conversation": (
        ["polar_cli/export/conversation.py", "polar_cli/export/openai_jsonl.py", "polar_cli/export/__init__.py"],
        [
            "tests/test_export_units.py",
            "tests/test_export.py",
            "tests/test_call_roles.py",
            "-k",
            "export and not every_api_dialects",
        ],
    ),
    # `polar rollout --ray`'s driver decisions on a fake Ray and fake actors (the queue, the early stop counted over
    # every node, a lost node's sessions, the stages display): run with --only on those (the rest starts proxies
    # on a real cluster, minutes per mutant).
    "rollout.ray_backend": (["polar_cli/rollout/ray_backend.py"], ["tests/test_ray_backend_units.py"]),
    # The live counters file the dashboard reads, loop --eval's schedule and loop.json entry, the harness and
    # runtime registries' lookup, and the rollout proxy's pure parts (endpoints, the fence, the session-mode
    # check, the control client on a mock transport; start_proxy runs mitmdump and is left to its own tests).
    "rollout.progress_file": (
        ["polar_cli/rollout/progress_file.py"],
        [
            "tests/test_progress_file_units.py",
            "tests/test_dashboard.py::test_progress_file_is_whole_current_and_redacted",
        ],
    ),
    "rollout.loop_eval": (
        ["polar_cli/rollout/loop_eval.py"],
        [
            "tests/test_loop_eval_units.py",
            "tests/test_loop_eval.py::test_the_schedule_is_the_base_every_nth_and_the_last",
            "tests/test_loop_eval.py::test_a_loop_entry_holds_pass_at_k_its_se_and_the_causes",
        ],
    ),
    "rollout.registry": (
        ["polar_cli/rollout/registry.py"],
        [
            "tests/test_registry_units.py",
            "tests/test_rollout_tasks.py::test_registries_name_what_exists",
            # (test_presets_python.py reads examples/, which the scratch copy lacks)
        ],
    ),
    "rollout.proxy": (
        ["polar_cli/rollout/proxy.py"],
        [
            "tests/test_rollout_proxy_units.py",
            "tests/test_killed_runs.py::test_the_fence_refuses_a_directory_a_live_proxy_still_writes",
        ],
    ),
    # The sandbox runtimes themselves, on fakes of the engines and processes (seconds a run, no sandbox started): the
    # interface's shared state, local's environment and limits, the proxy bridge's socats, the cgroup files, and the
    # exact bwrap / podman arguments (what is mounted, read-only or not, the network, the limits: the sandbox's
    # boundary). bwrap and oci with --only on those: the rest spawns the sandbox.
    "rollout.runtimes.base": (["polar_cli/rollout/runtimes/base.py"], ["tests/test_runtimes_base_units.py"]),
    "rollout.runtimes.local": (["polar_cli/rollout/runtimes/local.py"], ["tests/test_runtimes_local_units.py"]),
    "rollout.runtimes.bridge": (["polar_cli/rollout/runtimes/bridge.py"], ["tests/test_runtimes_bridge_units.py"]),
    "rollout.runtimes.cgroups": (["polar_cli/rollout/runtimes/cgroups.py"], ["tests/test_runtimes_cgroups_units.py"]),
    "rollout.runtimes.bwrap": (["polar_cli/rollout/runtimes/bwrap.py"], ["tests/test_runtimes_bwrap_units.py"]),
    "rollout.runtimes.oci": (
        ["polar_cli/rollout/runtimes/oci.py"],
        # the rest: one engine call, kill/cancel/stop, the runner's calls, the namespace holder (a fake engine script)
        ["tests/test_runtimes_oci_units.py", "tests/test_runtimes_oci_rest_units.py"],
    ),
    # The proxy's edges an agent writes to: the per-client body budget and the stream relay, the Responses
    # WebSocket's message handling, and `polar rollout --proxy`'s boundary check (no mitmdump, no engine).
    "relay": (
        ["polar_addon/relay.py"],
        [
            "tests/security/test_proxy.py::"
            "test_the_budget_is_per_client_across_connections_and_released_with_each_flow_or_connection",
            "tests/security/test_proxy.py::test_a_counted_body_is_dropped_once_over_its_cap_or_its_budget",
            "tests/test_relay_units.py",
        ],
    ),
    "responses_websocket": (
        ["polar_addon/responses_websocket.py"],
        [
            "tests/test_responses_websocket.py::test_sse_events_split_frames_and_skip_keepalives",
            "tests/test_responses_websocket.py::test_upgrade_detection_and_error_event",
            "tests/test_responses_websocket_units.py",
        ],
    ),
    "rollout.proxy_check": (
        ["polar_cli/rollout/proxy_check.py"],
        ["tests/security/test_proxy.py::test_the_probe_verdict", "tests/test_proxy_check_units.py"],
    ),
    # The mitmproxy addons, the proxy's boundary with the agent: the body limits (size, time, per-client budget;
    # with the parked replies and the shared refusal they answer through), which flows are intercepted or refused,
    # the control plane's flows and token, and how a model call reaches the gateway.
    "addons.body_limits": (
        ["polar_addon/addons/body_limits.py", "polar_addon/addons/replies.py", "polar_addon/addons/shared.py"],
        ["tests/test_addon_options.py", "tests/test_addons_body_limits_units.py"],
    ),
    "addons.scope": (
        ["polar_addon/addons/scope.py"],
        ["tests/test_addon_options.py", "tests/test_addons_scope_units.py"],
    ),
    "addons.control_plane": (
        ["polar_addon/addons/control_plane.py"],
        [
            "tests/test_addon_options.py",
            "tests/test_addons_control_plane_units.py",
            "tests/test_addons_control_plane_rest_units.py",  # the facts its help texts state
        ],
    ),
    "addons.capture": (
        ["polar_addon/addons/capture.py"],
        ["tests/test_addon_options.py", "tests/test_addons_capture_units.py"],
    ),
    # The exact prompt tokens a continued call is sent with (the delta after the sampled turn), and the recognition
    # of a harness's context compaction (which starts a new token chain).
    "continuity.delta": (
        ["polar_addon/continuity/delta.py"],
        # test_continuity_delta.py reads models/tiny, which the scratch copy lacks; the units file reads the run's.
        ["tests/test_continuity_delta_units.py"],
    ),
    "context_compaction": (
        ["polar_addon/context_compaction.py"],
        [
            "tests/test_context_compaction_units.py",
            "tests/test_call_roles.py::test_every_harness_compaction_prompt_makes_an_auxiliary_call",
            "tests/test_long_sessions.py::"
            "test_compaction_trigger_asks_the_engine_for_a_summary_and_answers_one_compaction_item",
            "tests/test_long_sessions.py::test_compaction_breaks_the_chain_with_cause_compaction",
            "tests/test_long_sessions.py::test_a_summary_without_its_marker_is_known_by_the_compaction_calls_answer",
        ],
    ),
    # The rewards and statuses the trainer reads: a reward's checks, the sessions view's precedence (latest reward,
    # error final), the status vocabulary and the store summary's counts.
    "store.rewards": (["polar_addon/store/rewards.py"], STORE_REWARD_UNITS),
    "store.sessions": (["polar_addon/store/sessions.py"], STORE_REWARD_UNITS),
    "store.status": (["polar_addon/store/status.py"], STORE_REWARD_UNITS),
    "store.summary": (["polar_addon/store/summary.py"], STORE_REWARD_UNITS),
    # The engine spec (a polar_engine value), the sticky session -> engine assignment, and the token id forms
    # every stored prompt goes through.
    "engines.spec": (
        ["polar_addon/engines/spec.py"],
        ["tests/test_engine_spec.py", "tests/test_engine_spec_affinity_units.py"],
    ),
    "engines.affinity": (
        ["polar_addon/engines/affinity.py"],
        ["tests/test_engine_affinity.py", "tests/test_engine_spec_affinity_units.py"],
    ),
    "token_ids": (
        ["polar_addon/token_ids.py"],
        ["tests/test_engine_prompt_fast_path.py", "tests/test_token_ids_units.py"],
    ),
    # The trace row and the dataset on disk that training reads (parts, their order, the stats file).
    "trace": (["polar_cli/trace.py"], ["tests/test_trace_output.py"]),
    "build.output": (["polar_cli/build/output.py"], ["tests/test_trace_output.py"]),
    # The sandbox runtimes' pure helpers, between the agent and the host: unpacking a tar a sandbox made, the disk
    # bound and its sampling, the cap on a harness's output, and the bwrap confinement's arguments, accounts and
    # ownership (run confine with --only on those: mount_tmpfs/unmount need root mounts).
    "rollout.runtimes.archive": (["polar_cli/rollout/runtimes/archive.py"], ["tests/security/test_archive_attacks.py"]),
    "rollout.runtimes.disk": (
        ["polar_cli/rollout/runtimes/disk.py"],
        [
            "tests/test_runtimes_units.py",
            "tests/security/test_runtime.py::test_the_disk_watchdog_samples_sooner_the_faster_the_directories_grow",
        ],
    ),
    "rollout.runtimes.output": (
        ["polar_cli/rollout/runtimes/output.py"],
        [
            "tests/test_runtimes_units.py",
            "tests/security/test_runtime.py::test_bounded_output_keeps_a_head_and_a_tail_and_says_what_it_dropped",
        ],
    ),
    "rollout.runtimes.confine": (
        ["polar_cli/rollout/runtimes/confine.py"],
        [
            "tests/test_runtimes_units.py",
            "tests/security/test_bwrap.py::test_every_parent_of_a_mount_point_is_made_0755_just_before_it",
            "tests/security/test_bwrap.py::test_etc_shows_only_its_allowlist_and_keeps_links_into_usr",
            "tests/security/test_bwrap.py::"
            "test_setid_bits_are_stripped_and_ownership_handed_over_without_following_links",
        ],
    ),
    # `polar train`'s staleness refusal and the LoRA merge an engine serves (run with --only on those: the rest trains).
    "train.run": (["polar_cli/train/run.py"], ["tests/test_train_run_units.py"]),
    # rollout.session's every stage (progress, INIT's retries, RUN's statuses, POSTRUN and each verification, status
    # posts, interruption) on fakes of the proxy, runtime, harness and verifier: seconds a mutant, where
    # rollout.session's own entry starts a real proxy (~40 s a mutant).
    "rollout.session.units": (["polar_cli/rollout/session.py"], ["tests/test_rollout_session_units.py"]),
    # The runner's plan, its refusals and its result's per-group rewards and masks (run with --only on those: the
    # rest drives harnesses and a proxy).
    "rollout.runner": (["polar_cli/rollout/runner.py"], ["tests/test_rollout_runner_units.py"]),
    # The async loop's staleness rule, busy fractions and batch records (run with --only on those: the rest runs
    # loops).
    "rollout.async_loop": (
        ["polar_cli/rollout/async_loop.py"],
        [
            "tests/test_async_loop_units.py",
            "tests/test_async_loop_keep_units.py",
            "tests/test_async_loop.py::test_groups_within_the_bound_are_kept_and_staler_ones_dropped_whole",
            "tests/test_async_loop.py::test_the_staleness_rule_refuses_nonsense",
            "tests/test_async_loop.py::test_busy_fraction_counts_overlaps_once_and_clips_to_the_window",
        ],
    ),
    # The build itself (pure: records and sessions in, traces and stats out), on the pure build tests.
    "build.pipeline": (
        ["polar_cli/build/__init__.py"],
        [
            "tests/test_build_traces.py",
            "tests/test_build_rewards.py",
            "tests/test_build_prefix_merging.py",
            "tests/test_call_roles.py",
            "-k",
            "not cli and not round_trip and not export",
        ],
    ),
    # The reconstruction health a build reports: stats summed per harness, the table, the mask rate per group.
    "build.stats": (
        ["polar_cli/build/stats.py"],
        [
            "tests/test_build_inputs_stats.py",
            "tests/test_build_rewards.py",
            "tests/test_build_prefix_merging.py",
        ],
    ),
    # What a build reads besides records: session rows, the tokenizer (the CLI and tito tests that also reach it
    # take a minute a mutant).
    "build.inputs": (
        ["polar_cli/build/inputs.py"],
        ["tests/test_build_inputs_stats.py"],
    ),
    # The trace row built from a chain's or one call's records: versions, identities, sampling fields.
    "build.traces": (
        ["polar_cli/build/traces.py", "polar_cli/build/per_request.py"],
        [
            "tests/test_build_traces.py",
            "tests/test_build_rewards.py",
            "tests/test_build_prefix_merging.py",
            "tests/test_call_roles.py::test_per_request_traces_carry_their_call_role",
        ],
    ),
    # What every call's record holds (record_ok / record_failed) and the logprob check at capture.
    "capture": (
        ["polar_addon/capture.py"],
        [
            "tests/test_capture_records.py",
            "tests/test_call_roles.py::test_records_carry_their_role",
            "tests/test_call_roles.py::test_roles_round_trip_the_store_and_older_shards_read_them_as_null",
            "tests/test_gateway_sampling.py::test_logprob_problems_are_named",
            "tests/test_gateway_sampling.py::test_plausible_logprobs_pass",
        ],
    ),
    # The token budget per forward, the checkpointing switch and the step plan (the pure tests: the rest train).
    "train.budget": (
        ["polar_cli/train/budget.py"],
        [
            "tests/test_train_budget_units.py",
            "tests/test_train_budget.py",
            "-k",
            "not budgeted and not trained_positions and not run_says",
        ],
    ),
    # The trained-positions head whose logprobs the loss uses, on a toy model with hand-chosen logits (the Qwen2-shaped
    # check against a full log_softmax, test_train_budget.py's trained_positions, takes ~16 s a mutant).
    "train.logprobs": (["polar_cli/train/logprobs.py"], ["tests/test_train_logprobs_units.py"]),
    # The control channel: who may post rewards, statuses and registrations, and what they may say (its plain
    # functions and ControlPlane driven in-process; the tests through a real mitmdump take seconds a mutant).
    "control": (
        ["polar_addon/control.py"],
        [
            "tests/test_control_units.py",
            "tests/security/test_sessions.py::test_a_status_post_ends_the_registered_session",
            "tests/test_gateway_core.py::test_a_session_that_ends_frees_its_engine_slot",
        ],
    ),
    # The context window each session's harness budgets by, read from the engine spec (no engine runs).
    "rollout.window": (
        ["polar_cli/rollout/window.py"],
        ["tests/test_rollout_window.py", "tests/test_rollout_window_redact.py"],
    ),
    # What is kept out of a rollout's manifest, summary and logs (the agent chooses what its harness prints).
    "rollout.redact": (
        ["polar_cli/rollout/redact.py"],
        [
            "tests/security/test_runtime.py::test_redact_hides_tokens_credentials_and_secret_options",
            "tests/test_rollout_window_redact.py",
        ],
    ),
    # The fenced-JSON fallback and the parser chain that runs it (which calls a small model's text becomes).
    "tool_parsers.fenced_json": (
        ["polar_addon/tool_parsers/fenced_json.py", "polar_addon/tool_parsers/__init__.py"],
        ["tests/test_tool_parsers_fenced_json.py"],
    ),
    # Which chain a call continues and the prompt it is sent with (run on the plain-function tests: the rest of
    # the file drives a gateway, ~30 s a mutant).
    "continuity.chains": (
        ["polar_addon/continuity/chains.py"],
        [
            "tests/test_tito_gateway.py",
            "tests/test_continuity_fast_paths.py",
            "-k",
            "bounded or another_engine or told or judge or compaction_verdict or mode or without_chains"
            " or continuation or newest_first or token_input or walked",
        ],
    ),
    # The canonical form every provider translates to: sampling defaults and their checks, the assistant message
    # sent back, token counts, the errors providers answer with.
    "canonical": (
        ["polar_addon/canonical.py"],
        [
            "tests/test_canonical.py",
            "tests/test_gateway_sampling.py",
            "tests/test_continuity.py",
            "tests/test_provider_openai_chat.py",
            "tests/test_provider_common.py",
        ],
    ),
    # What an HTTP engine's answer becomes: the prompt and sampled token ids, the logprobs, the calls (run with --only
    # on the parsing functions: the rest is the client, tested against real servers).
    "engines.openai_compat": (["polar_addon/engines/openai_compat.py"], OPENAI_COMPAT_UNITS),
    # The <think> split every Qwen format shares, and the call ids polar mints.
    "tool_parsers.reasoning": (
        ["polar_addon/tool_parsers/reasoning.py", "polar_addon/tool_parsers/calls.py"],
        [
            "tests/test_tool_parsers_reasoning.py",
            "tests/test_tool_parsers_hermes.py",
            "tests/test_tool_parsers_qwen3_coder.py",
        ],
    ),
}


_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def _scratch(module: str, timeout_multiplier: float) -> Path:
    """A fresh copy of the code and tests with a [tool.mutmut] section for this module."""
    work = WORK / module
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    for name in ("polar_addon", "polar_cli", "tests", "bench"):  # tests/test_fidelity.py imports bench/
        shutil.copytree(REPO / name, work / name, ignore=_IGNORE)
    _configure(module, work, timeout_multiplier)
    return work


def _configure(module: str, work: Path, timeout_multiplier: float) -> None:
    files, tests = MODULES[module]
    config = "\n".join(
        [
            "",
            "[tool.mutmut]",
            'source_paths = ["polar_addon", "polar_cli"]',
            'also_copy = ["bench"]',
            f"only_mutate = {json.dumps(files)}",
            f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
            'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"]',
            # A mutant that deadlocks a writer thread burns no CPU: only mutmut's wall-clock limit,
            # (its tests' clean-run time + 1 s) x this multiplier, ends it. mutmut's default, 15, let a
            # few hung store mutants stall a run for minutes each.
            f"timeout_multiplier = {timeout_multiplier}",
            "",
        ]
    )
    (work / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text() + config)


def _tiny_model() -> Path:
    """One tiny model for every test session of every mutant (building it takes seconds)."""
    path = WORK / "tiny"
    if not (path / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "polar_cli.app", "tiny-model", str(path)], cwd=REPO, check=True, env=_env()
        )
    return path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # mutants/ must win the imports
    env["PYTHONPATH"] = ""
    return env


def _mutmut(work: Path, args: list[str], lock: str | None, log_name: str) -> None:
    env = _env()
    env["POLAR_TEST_TINY_MODEL"] = str(_tiny_model())
    cmd = ["nice", "-n", str(NICE), str(MUTMUT), "run", *args]
    if lock:
        cmd = ["flock", lock, *cmd]
    with open(work / log_name, "wb") as log:
        subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)


def _not_killed(work: Path) -> dict[str, str]:
    """mutant -> status for every mutant not killed (``mutmut results`` lists only those)."""
    results = subprocess.run(
        [str(MUTMUT), "results"], cwd=work, env=_env(), capture_output=True, text=True, check=False
    )
    (work / "survivors.txt").write_text(results.stdout)
    return _listing(results.stdout)


def _listing(text: str) -> dict[str, str]:
    rows = (line.strip().rsplit(": ", 1) for line in text.splitlines() if ": " in line)
    return {name: status for name, status in rows}


def _slowest(work: Path, count: int, lock: str | None, only: list[str] | None = None) -> list[str]:
    """The ``count`` mutants with the longest estimated test time that some test reaches.

    mutmut runs the mutants quickest first, so a run stopped early (the 2032 of openai_responses on the
    shared VM) has measured only the quick end; this selects the other end. mutmut makes the mutants and
    its per-test timings only inside ``run``: a run filtered on a name that matches nothing does just
    that and stops. The estimate is mutmut's own (the summed clean times of the tests reaching the
    mutant's function), read from its files: ``mutmut print-time-estimates`` cannot be used, as it
    drops every test association when no mutants were made in its own process (3.8.1). ``only``: shell
    patterns (``*final_status*``) the names must match, as for a module's new functions.
    """
    _mutmut(work, ["polar-prepare-only-matches-no-mutant"], lock, "prepare.log")  # fails at the filter, by design
    stats = json.loads((work / "mutants" / "mutmut-stats.json").read_text())
    tests_of, duration = stats["tests_by_mangled_function_name"], stats["duration_by_test"]
    names = [
        name for meta in (work / "mutants").rglob("*.meta") for name in json.loads(meta.read_text())["exit_code_by_key"]
    ]
    estimate = {
        name: sum(duration.get(t, 0.0) for t in tests_of.get(name.rsplit("__mutmut_", 1)[0], [])) for name in names
    }
    # Names without a test are left out: mutmut would look their tests up by name and fail.
    timed = sorted((n for n in names if tests_of.get(n.rsplit("__mutmut_", 1)[0])), key=lambda n: estimate[n])
    if only:
        untested = [n for n in names if n not in estimate or not tests_of.get(n.rsplit("__mutmut_", 1)[0])]
        (work / "selected_untested.txt").write_text(
            "".join(f"{n}\n" for n in untested if any(fnmatch.fnmatch(n, p) for p in only))
        )
        timed = [n for n in timed if any(fnmatch.fnmatch(n, pattern) for pattern in only)]
    return timed[-count:] if count else timed


def run(
    module: str,
    lock: str | None,
    children: int,
    timeout_multiplier: float,
    resume: bool = False,
    slowest: int = 0,
    only: list[str] | None = None,
) -> None:
    """Mutate the module and run every mutant; ``resume`` keeps an interrupted run's verdicts and runs the rest.

    mutmut saves each verdict as it comes, so a big module (the gateway: hundreds of mutants at seconds each)
    can be stopped and taken up again later instead of restarted. ``slowest`` runs only that many mutants,
    those with the longest estimated test time (see ``_slowest``); the others stay without a verdict, and
    the report marks the score partial.
    """
    work = WORK / module
    if resume and (work / "mutants").exists():
        _configure(module, work, timeout_multiplier)
    else:
        work = _scratch(module, timeout_multiplier)
    selecting = bool(slowest or only)
    names = _slowest(work, slowest, lock, only) if selecting else []
    if selecting and not names:
        raise SystemExit(f"{module}: no mutant reached by a test matches {only}")
    if selecting:
        (work / "selected.txt").write_text("".join(f"{name}\n" for name in names))
    _mutmut(work, ["--max-children", str(children), *names], lock, "run.log")
    subprocess.run([str(MUTMUT), "export-cicd-stats"], cwd=work, env=_env(), capture_output=True, check=False)
    _not_killed(work)


def rerun_not_killed(module: str, lock: str | None, children: int, timeout_multiplier: float) -> None:
    """Run the mutants an earlier run did not kill against the current tests (new tests can only add kills).

    The earlier run's mutants are kept; its tests and bench/ are replaced by the current ones. mutmut resets
    every verdict when the test selection changes, so the score is merged here: killed before, or now.
    """
    work = WORK / module
    # The last verdicts: survivors.txt, as the first run or the last re-run merged them. mutmut's own results hold
    # only its last invocation's, so after a re-run they call every mutant it did not retry "not checked".
    listed = work / "survivors.txt"
    before = _listing(listed.read_text()) if listed.is_file() else _not_killed(work)
    stats_before = score(module)
    if stats_before is None:
        raise SystemExit(f"{module} has not been run yet")
    for base in (work, work / "mutants"):
        for name in ("tests", "bench"):
            shutil.rmtree(base / name, ignore_errors=True)
            shutil.copytree(REPO / name, base / name, ignore=_IGNORE)
    _configure(module, work, timeout_multiplier)
    retried = [name for name, status in before.items() if status in ("survived", "no tests")]
    _mutmut(work, ["--max-children", str(children), *retried], lock, "rerun.log")
    after = _not_killed(work)
    merged = {name: after.get(name, "killed") if name in retried else status for name, status in before.items()}
    (work / "survivors.txt").write_text("".join(f"    {n}: {s}\n" for n, s in merged.items() if s != "killed"))
    counts = {status: list(merged.values()).count(status) for status in set(merged.values())}
    stats = dict(
        stats_before,
        survived=counts.get("survived", 0),
        no_tests=counts.get("no tests", 0),
        timeout=stats_before["timeout"] + sum(after.get(n) == "timeout" for n in retried),
    )
    # Mutants an --only run never checked stay unchecked (the report counts them as not run, never as killed).
    stats["killed"] = (
        stats["total"]
        - stats["skipped"]
        - stats["survived"]
        - stats["no_tests"]
        - stats["timeout"]
        - stats["segfault"]
        - stats["suspicious"]
        - counts.get("not checked", 0)
    )
    stats["rerun_of_not_killed"] = len(retried)
    (work / "mutants" / "mutmut-cicd-stats.json").write_text(json.dumps(stats, indent=4))


def verify_timeouts(module: str, limit_s: float = 300.0, jobs: int = 1) -> None:
    """Re-run each mutant mutmut stopped on time alone, with no CPU limit and a long wall limit, against the
    tests mutmut recorded as reaching its function.

    mutmut counts a timeout as a kill; on a loaded machine a mutant whose tests merely ran slowly is
    stopped too. Each is run again here: a test failure is a kill, a pass a survivor, and only a run past
    ``limit_s`` a real hang. The verdicts go to ``timeouts.txt`` and a survivor is put back in the score.
    """
    work = WORK / module
    _, tests = MODULES[module]
    statuses = _not_killed(work)
    env = _env()
    env["POLAR_TEST_TINY_MODEL"] = str(_tiny_model())
    # Verdicts already reached (an earlier call on a run still going, or one stopped) are kept: the mutants
    # do not change within a scratch copy.
    verdicts: dict[str, str] = {}
    progress = work / "timeouts.partial.txt"  # one line per verdict as it comes (a long run can be read early)
    for earlier in (work / "timeouts.txt", progress):
        if earlier.exists():
            rows = (line.strip().rsplit(": ", 1) for line in earlier.read_text().splitlines() if ": " in line)
            verdicts.update({name: verdict for name, verdict in rows})
    progress.write_text("".join(f"    {n}: {v}\n" for n, v in verdicts.items()))
    # Only the tests mutmut itself ran against the mutant (those that reach its function), as mutmut does:
    # the whole selection per mutant took minutes each on the shared VM (trace_store's has fault tests).
    stats_path = work / "mutants" / "mutmut-stats.json"
    covering = json.loads(stats_path.read_text())["tests_by_mangled_function_name"] if stats_path.exists() else {}

    def selection_of(name: str) -> list[str]:
        return sorted(covering.get(name.rsplit("__mutmut_", 1)[0], [])) or tests

    def verdict_of(name: str) -> str:
        cmd = [
            "nice",
            "-n",
            str(NICE),
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            *selection_of(name),
        ]
        try:
            done = subprocess.run(
                cmd,
                cwd=work / "mutants",
                env=dict(env, MUTANT_UNDER_TEST=name),
                capture_output=True,
                timeout=limit_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return "hung"
        return "killed" if done.returncode == 1 else "survived" if done.returncode == 0 else "error"

    # The quickest first (fewest tests): a stopped verification has settled as many as it could. A hang burns no
    # CPU, so several run at once (``jobs``); the limit must stay far above a clean run's time under that load.
    todo = sorted(
        (n for n, status in statuses.items() if status == "timeout" and n not in verdicts),
        key=lambda n: len(selection_of(n)),
    )
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for name, verdict in zip(todo, pool.map(verdict_of, todo)):
            verdicts[name] = verdict
            with progress.open("a") as out:
                out.write(f"    {name}: {verdict}\n")
    timed_out = {n for n, status in statuses.items() if status == "timeout"}
    verdicts = {n: v for n, v in verdicts.items() if n in timed_out}
    (work / "timeouts.txt").write_text("".join(f"    {n}: {v}\n" for n, v in verdicts.items()))
    stats = score(module)
    if stats is not None:
        back = sum(v == "survived" for v in verdicts.values())
        # From mutmut's own counts each time, so verifying again (more timeouts, or none new) never subtracts twice.
        before = {key: stats.get(f"{key}_before_verify", stats[key]) for key in ("timeout", "survived")}
        stats.update(
            timeout=before["timeout"] - back,
            survived=before["survived"] + back,
            timeouts_verified=len(verdicts),
            timeout_before_verify=before["timeout"],
            survived_before_verify=before["survived"],
        )
        (work / "mutants" / "mutmut-cicd-stats.json").write_text(json.dumps(stats, indent=4))


def score(module: str) -> dict[str, int] | None:
    path = WORK / module / "mutants" / "mutmut-cicd-stats.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def report() -> None:
    print(
        f"{'module':28s} {'mutants':>8s} {'killed':>7s} {'survived':>9s} {'no tests':>9s} {'not run':>8s} {'score':>7s}"
    )
    for module in MODULES:
        stats = score(module)
        if stats is None:
            print(f"{module:28s} {'(not run)':>8s}")
            continue
        caught = stats["killed"] + stats["timeout"] + stats["segfault"]
        total = stats["total"] - stats["skipped"]
        # An interrupted run (see --resume) leaves mutants with no verdict: counted, never as killed.
        not_run = (
            total
            - caught
            - stats["survived"]
            - stats["no_tests"]
            - stats["suspicious"]
            - stats["check_was_interrupted_by_user"]
        )
        # Of the mutants run: a partial run's score is marked, never read as the module's.
        pct = 100.0 * caught / (total - not_run) if total > not_run else float("nan")
        print(
            f"{module:28s} {total:8d} {caught:7d} {stats['survived']:9d} {stats['no_tests']:9d} {not_run:8d}"
            f" {pct:6.1f}%{' (partial)' if not_run else ''}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help=f"some of: {', '.join(MODULES)} (default: all)")
    parser.add_argument("--report", action="store_true", help="only print the scores of earlier runs")
    parser.add_argument("--lock", help="flock this file around each module's run")
    parser.add_argument(
        "--verify-timeouts",
        action="store_true",
        help="re-run each mutant mutmut stopped on time, without its time limits (see verify_timeouts)",
    )
    parser.add_argument(
        "--verify-limit",
        type=float,
        default=300.0,
        help="with --verify-timeouts: seconds after which a mutant's run counts as a hang (default 300)",
    )
    parser.add_argument(
        "--verify-jobs",
        type=int,
        default=1,
        help="with --verify-timeouts: mutants verified at once (a hang burns no CPU; keep the "
        "limit far above a clean run's time under that load)",
    )
    parser.add_argument(
        "--rerun-not-killed",
        action="store_true",
        help="re-run only the mutants the last run of each module did not kill, with the current tests",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the verdicts of an interrupted run of each module and run only the mutants it left",
    )
    parser.add_argument(
        "--slowest",
        type=int,
        default=0,
        help="run only this many mutants, those with the longest estimated test time (the ones a"
        " stopped quickest-first run never reached); the score is then marked partial",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="PATTERN",
        help="run only the mutants whose names match these shell patterns (e.g. '*final_status*');"
        " those no test reaches are listed in selected_untested.txt; the score is marked partial",
    )
    parser.add_argument("--children", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--timeout-multiplier",
        type=float,
        default=6.0,
        help="a mutant is stopped after (its tests' clean time + 1 s) x this (default 6)",
    )
    args = parser.parse_args()
    unknown = set(args.modules) - set(MODULES)
    if unknown:
        parser.error(f"unknown modules {sorted(unknown)}; choose from {', '.join(MODULES)}")
    if not args.report:
        for module in args.modules or list(MODULES):
            print(f"mutating {module} ...", flush=True)
            if args.verify_timeouts:
                verify_timeouts(module, args.verify_limit, args.verify_jobs)
            elif args.rerun_not_killed:
                rerun_not_killed(module, args.lock, args.children, args.timeout_multiplier)
            else:
                run(
                    module,
                    args.lock,
                    args.children,
                    args.timeout_multiplier,
                    resume=args.resume,
                    slowest=args.slowest,
                    only=args.only,
                )
    report()


if __name__ == "__main__":
    main()
