"""Job-level failures: what makes a whole job fail (as opposed to a row's `RowError`)."""


class InputError(ValueError):
    """The input cannot be read as the spec says (not Parquet, a required column absent, …).

    The message is written for the user: the API returns it at submit, or the job fails with it.
    """
