"""DFlash drafter trainer: named runs of a block-diffusion drafter on a frozen target."""

__version__ = "0.1.0"
