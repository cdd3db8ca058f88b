"""Fixtures shared by tests and benchmarks."""

from jaxrl.testing.reference import REQUIRE_REFERENCE_ENV, import_reference

__all__ = ["REQUIRE_REFERENCE_ENV", "import_reference"]
