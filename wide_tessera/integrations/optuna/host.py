"""Optuna itself, or None where the extra is not installed (optimize() then says so): the one
place the integration imports it."""

try:
    import optuna
except ImportError:  # pragma: no cover
    optuna = None  # type: ignore[assignment]

__all__ = ["optuna"]
