"""The answer-key guard: finding and redacting key text, its index, keeping
it current, the audit of runs/."""
