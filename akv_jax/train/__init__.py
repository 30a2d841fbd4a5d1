"""Training under cache engineering: every token predicted from exactly the view it had."""
