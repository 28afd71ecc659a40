"""What the service and the handlers run on: the LLM call, the sealed log, the state store."""
