"""Export trained drafts into the layouts vLLM and SGLang load."""
