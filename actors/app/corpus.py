"""A fixed English text for benchmarks and tests: the standard library's module docstrings.

The same Python version gives the same text, so prompts cut from it are reproducible without
shipping a data file.
"""

from __future__ import annotations

import argparse
import collections
import decimal
import email
import json
import logging
import os
import pathlib
import re
import subprocess
import textwrap
import threading
import unittest

_MODULES = (
    argparse,
    collections,
    decimal,
    email,
    json,
    logging,
    os,
    pathlib,
    re,
    subprocess,
    textwrap,
    threading,
    unittest,
)


def natural_text() -> str:
    """A few thousand words of English prose."""
    return " ".join(" ".join((m.__doc__ or "").split()) for m in _MODULES)
