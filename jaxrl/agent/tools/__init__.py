"""Tools: the interface (`base`), the YAML registry, and the shipped tools (`calculator`,
`gsm8k`, `code`)."""
