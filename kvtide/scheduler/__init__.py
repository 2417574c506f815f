"""Token-budget scheduler: pure CPU policy that decides which tokens are computed each step."""
