"""Generic benchmark machinery: nothing in this package knows about any particular op."""
