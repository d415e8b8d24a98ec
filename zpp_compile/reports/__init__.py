"""What zeropp tells about a step: the communication ledger, the predicted bytes (`explain`), the dumps
and their pictures, plain-text tables."""
