"""sleuth: finds what is wrong with a drafter run, with evidence for every claim."""

__version__ = "0.1.0"
