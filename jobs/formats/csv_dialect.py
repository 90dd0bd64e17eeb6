"""How a job's CSV or TSV text is read: its delimiter, its encoding, and pyarrow's options for both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from bulkinfer.jobs.formats.text_encoding import DEFAULT_CSV_ENCODING, is_utf8
from bulkinfer.jobs.spec import DELIMITED_FORMATS, InputFormat, JobSpec

if TYPE_CHECKING:
    import pyarrow.csv as pa_csv

DELIMITERS = {InputFormat.CSV: ",", InputFormat.TSV: "\t"}
MIN_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class CsvDialect:
    delimiter: str = ","
    encoding: str = DEFAULT_CSV_ENCODING

    @classmethod
    def of(cls, file_format: InputFormat | str) -> CsvDialect:
        """The dialect pyarrow writes (UTF-8) and every output part is read back in."""
        return cls(DELIMITERS[InputFormat(file_format)])

    @classmethod
    def of_input(cls, spec: JobSpec) -> CsvDialect:
        if spec.input_format not in DELIMITED_FORMATS:
            raise ValueError("a CSV dialect needs CSV or TSV input")
        return cls(DELIMITERS[spec.input_format], spec.csv_encoding or DEFAULT_CSV_ENCODING)

    @property
    def delimiter_bytes(self) -> bytes:
        return self.delimiter.encode()

    @property
    def is_utf8(self) -> bool:
        return is_utf8(self.encoding)

    def read_options(self, column_names: list[str] | None, data_bytes: int) -> pa_csv.ReadOptions:
        """One block for the whole of `data_bytes` (pyarrow refuses a row that straddles two)."""
        import pyarrow.csv as pa_csv

        return pa_csv.ReadOptions(column_names=column_names, use_threads=False,
                                  encoding="utf8" if self.is_utf8 else self.encoding,
                                  block_size=max(MIN_BLOCK_BYTES, data_bytes + 1))

    def parse_options(self) -> pa_csv.ParseOptions:
        import pyarrow.csv as pa_csv

        return pa_csv.ParseOptions(delimiter=self.delimiter, quote_char='"', double_quote=True,
                                   escape_char=False, newlines_in_values=True, ignore_empty_lines=True)
