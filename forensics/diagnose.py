"""The diagnosis' entry points (kept under this name for notebooks and older callers);
the stages live in :mod:`forensics.diagnosis`."""
from __future__ import annotations

from .diagnosis import (Diagnosis, RunDiagnoses, Event, Evidence, Finding, Hit, NothingToDiagnose, RootCause, RunConfig, RunFacts,
                        diagnose, ensure_views, headline, render)

__all__ = ["diagnose", "headline", "render", "Diagnosis", "RunDiagnoses", "RootCause", "Evidence", "Finding", "NothingToDiagnose",
           "ensure_views", "RunFacts", "RunConfig", "Hit", "Event"]
