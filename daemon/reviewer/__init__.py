"""The built-in reviewer `builtin/craft-metrics`: parsing, craft statistics,
its report, claims, craft distance."""
