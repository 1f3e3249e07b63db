"""Speculative decoding: the drafters that propose tokens for the target model to verify.

Pure Python + numpy (no torch, no actors): the scheduler calls a drafter in its step loop.
"""

from actors.speculation.drafters import (
    METHODS,
    Drafter,
    PromptLookupDrafter,
    SuffixDrafter,
    make_drafter,
)

__all__ = ["METHODS", "Drafter", "PromptLookupDrafter", "SuffixDrafter", "make_drafter"]
