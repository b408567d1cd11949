"""Training recipes: whole procedures that produce a trained target/draft pair or an experiment's result.

* :mod:`.code_pair`: corpus -> tokenizer -> target -> LongSpec draft on Python code (the shipped pair;
  ``python -m longspec.recipes.code_pair``).
* :mod:`.draft_objective`: cross-entropy against CE + KL for the draft, on a small byte-level target (CPU;
  ``python -m longspec.recipes.draft_objective``).
"""
