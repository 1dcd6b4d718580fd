"""A one-call agent for `polar rollout --harness cmd:...`, written with the official openai SDK and unaware of
polar: the cmd preset's environment (OPENAI_BASE_URL, OPENAI_API_KEY carrying the session's identity) sends its
call through polar. It writes the model's answer to answer.txt in its working directory (the session's workspace).

    python agent.py "INSTRUCTION"
"""

import os
import sys
from pathlib import Path

from openai import OpenAI

reply = OpenAI(max_retries=0).chat.completions.create(
    model=os.environ.get("POLAR_MODEL", "policy"),
    messages=[{"role": "user", "content": sys.argv[1]}],
    max_tokens=16,
    temperature=1.0,
)
Path("answer.txt").write_text(reply.choices[0].message.content or "")
