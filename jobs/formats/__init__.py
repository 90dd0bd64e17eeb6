"""Row formats: readers that turn input records into `Row`s, and writers for output parts."""
