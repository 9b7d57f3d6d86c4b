"""The layout advisor's former name: ``python -m hybridpar.plan`` runs :mod:`hybridpar.advisor`.

Kept so that commands and imports written for it go on working; new code imports
:mod:`hybridpar.advisor`.
"""

import sys

from hybridpar.advisor import Advice, Candidate, advise, format_advice, main, parse_bytes

__all__ = ["Advice", "Candidate", "advise", "format_advice", "main", "parse_bytes"]

if __name__ == "__main__":
    sys.exit(main())
