"""Job-level failures: what makes a whole job fail (as opposed to a row's `RowError`)."""


class InputError(ValueError):
    """The input cannot be read as the spec says (not Parquet, a required column absent, …).

    The message is written for the user: the API returns it at submit, or the job fails with it.
    """


class LookupFailed(LookupError):
    """Something asked for by name or id is not there; the message is shown as is (LookupError
    alone would quote it like a dict key)."""

    def __str__(self) -> str:
        return str(self.args[0])
