"""improved: the self-improve daemon of a service mesh."""
