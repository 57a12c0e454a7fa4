"""Speculative decoding: proposers that guess a sequence's next tokens without running the
target model, and the bookkeeping that sizes each guess.

The scheduler asks a proposer for tokens (ngram: prompt lookup; draft: a smaller model,
kvlab.spec.draft) and appends them to the sequence as tokens it has not computed; one step
computes them beside everything else; the engine verifies them against the model
(kvlab.spec.verify) and keeps the accepted run. How many to propose follows each sequence's
acceptance and the engine's measured step costs (kvlab.spec.adaptive).
"""
