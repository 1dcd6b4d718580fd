#!/bin/bash
set -euo pipefail
cd /app
sed -i 's|return text.lower() + "!"|return text.upper() + "!"|' text.py
