#!/bin/sh
cd "$(dirname "$0")" && exec "${PYTHON:-python}" train.py --steps 2 "$@"
