#!/bin/bash
# Harbor verifier: the task's own copy of the tests (in /tests, never shown to the agent) against the
# agent's /app; reward 1 when they pass.
mkdir -p /logs/verifier
cd /app
if python3 -m unittest discover -s /tests -p 'test_*.py'; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
