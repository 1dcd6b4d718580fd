#!/bin/bash
set -euo pipefail
cd /app
sed -i 's|return sum(values) / (len(values) + 1)|return sum(values) / len(values)|' stats.py
