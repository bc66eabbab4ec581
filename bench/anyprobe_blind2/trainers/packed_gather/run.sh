#!/bin/bash
cd "$(dirname "$0")"
${PYTHON:-python} train.py --steps 2 "$@"
