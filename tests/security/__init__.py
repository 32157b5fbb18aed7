"""Security tests: fuzzing, hostile input, authentication and SSRF against a real gateway."""
