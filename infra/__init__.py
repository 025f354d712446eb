"""Infrastructure that features/, models/ and flows/ share: params validation and one-line
errors, atomic files, device choice, finiteness checks, training checkpoints."""
