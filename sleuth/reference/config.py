"""Where sleuth looks for reference checkouts and keeps its cache.

Checkout, first that is set:  --path  >  SLEUTH_<NAME>_PATH  >  config file `references.<name>.path`
(> the tool's own cache clone, handled by the chain). Config file: SLEUTH_CONFIG_FILE, else
platformdirs user_config_dir("sleuth")/config.yaml. Cache: SLEUTH_CACHE_DIR, else user_cache_dir("sleuth").
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from sleuth.reference.model import ReferenceError

CACHE_DIR_ENV = "SLEUTH_CACHE_DIR"
CONFIG_FILE_ENV = "SLEUTH_CONFIG_FILE"


def checkout_env_var(name: str) -> str:
    """`speculators` -> SLEUTH_SPECULATORS_PATH; `z-lab-dflash` -> SLEUTH_Z_LAB_DFLASH_PATH."""
    return "SLEUTH_" + re.sub(r"[^A-Za-z0-9]+", "_", name).upper() + "_PATH"


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("sleuth"))


def config_file() -> Path:
    override = os.environ.get(CONFIG_FILE_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_config_dir("sleuth")) / "config.yaml"


@dataclass(frozen=True)
class CheckoutChoice:
    path: Path
    origin: str  # "--path", the env var name, or "config <file>"


def configured_checkout(name: str, path: Path | None) -> CheckoutChoice | None:
    """The user's checkout for `name`, if one is configured anywhere; None means use the cache clone."""
    if path is not None:
        return CheckoutChoice(Path(path).expanduser(), "--path")
    env_var = checkout_env_var(name)
    if os.environ.get(env_var):
        return CheckoutChoice(Path(os.environ[env_var]).expanduser(), env_var)
    file = config_file()
    if not file.is_file():
        return None
    data = read_config_file(file)
    references = data.get("references") if isinstance(data, dict) else None
    if references is not None and not isinstance(references, dict):
        raise ReferenceError(f"config file {file}: `references` must map reference names to {{path: ...}}")
    entry = (references or {}).get(name)
    if isinstance(entry, dict) and entry.get("path"):
        return CheckoutChoice(Path(str(entry["path"])).expanduser(), f"config {file}")
    return None


def read_config_file(file: Path) -> object:
    """sleuth's config file as data; ReferenceError (one line) when it cannot be read as YAML."""
    import yaml

    from sleuth.safe_yaml import YamlLimitError, describe_decode_error, load_yaml, read_text_file

    try:
        return load_yaml(read_text_file(file, what="config file")) or {}
    except UnicodeDecodeError as exc:
        raise ReferenceError(f"config file {file} {describe_decode_error(exc)}") from None
    except OSError as exc:
        raise ReferenceError(f"config file {file} cannot be read: {exc.strerror or exc}") from None
    except YamlLimitError as exc:
        raise ReferenceError(f"config file {file}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ReferenceError(f"config file {file} is not valid YAML: {str(exc).splitlines()[0]}") from None
