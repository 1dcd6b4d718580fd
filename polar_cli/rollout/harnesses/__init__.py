"""Harness presets: one module each (``claude_code``, ``codex``, ``qwen_code``, ``pi``, ``gemini_cli``,
``command``), all behind :class:`base.HarnessPreset`."""
