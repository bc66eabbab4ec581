#!/bin/bash
cd "$(dirname "$0")"
${PYTHON:-python} train.py --config dflash.json --steps 2 "$@"
