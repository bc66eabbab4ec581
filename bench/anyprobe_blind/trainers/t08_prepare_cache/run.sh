#!/bin/sh
cd "$(dirname "$0")" && "${PYTHON:-python}" train.py prepare "$@" && exec "${PYTHON:-python}" train.py train --steps 2 "$@"
