"""`hylora doctor`: differential verification of a deployment that serves LoRA adapters.

It compares what a deployment serves — hylora in this process, or any OpenAI-compatible server —
with hylora's merged-weights reference, per adapter and for the base, at prompt lengths straddling
every kernel boundary, alone and in mixed batches, before and after long requests and faults.
`hylora doctor --help` lists the flags; docs/DOCTOR.md explains each check.
"""

from hylora.doctor.compare import Tolerance
from hylora.doctor.doctor import DoctorOptions, Report, run_doctor
from hylora.doctor.result import CheckResult, Status

__all__ = ["CheckResult", "DoctorOptions", "Report", "Status", "Tolerance", "run_doctor"]
