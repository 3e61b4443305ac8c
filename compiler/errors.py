"""Typed errors. Each names what was wrong and what was expected, so a user can fix it."""

from __future__ import annotations


class KilnError(Exception):
    """Base of every error kiln raises on purpose."""


class InputSpecError(KilnError, ValueError):
    """A spec is malformed (min > max, unbounded range) or a call's input falls outside its spec."""


class ExportError(KilnError):
    """torch.export could not trace the model."""


class PartitionError(KilnError):
    """A partition plan cannot be made or replayed (a package's plan disagrees with its program)."""


class OptionsError(PartitionError, ValueError):
    """A compile option is invalid (unknown precision or op name, bad min_block_size, a device that is no
    device): raised where options are checked. A PartitionError, as bad options were before it existed,
    so ``except PartitionError`` still catches it."""


class LoweringError(KilnError):
    """A partition could not be lowered to ONNX."""


class BackendError(KilnError):
    """An engine backend failed to build, load or run an engine."""


class BackendUnavailableError(BackendError):
    """The backend's library (or its device) is not present here."""


class EngineBuildError(BackendError):
    """An engine build failed; carries the partition and the failing node when the library names one."""

    def __init__(self, message: str, *, partition: str | None = None, node: str | None = None):
        super().__init__(message)
        self.partition = partition
        self.node = node


class BuildSettingsError(BackendError, ValueError):
    """Build settings a backend cannot use (an unknown ``backend_options`` value, a bad workspace,
    level or target). A mistake in the request, not in the graph: it never falls back to another
    backend (``on_build_failure``) and is never retried."""


class EngineCompatibilityError(BackendError):
    """An engine was built for another device or library version."""


class RefitError(KilnError):
    """Weights given for refit do not match the engine: wrong names, shapes or dtypes."""


class CacheError(KilnError):
    """The engine cache cannot be used (bad directory, bad settings)."""


class PackageError(KilnError):
    """A saved package cannot be read."""


class PackageCorruptError(PackageError):
    """A package file is missing, truncated or does not match its checksum."""


class UntrustedJsonError(KilnError, ValueError):
    """JSON kiln did not write itself (a package file, a cache record, a Triton model folder's files,
    webhook state) is larger, nests deeper or holds a larger integer than ``compiler.json_reader``
    allows, is not UTF-8 JSON, or does not fit its schema. The message names the file and the field
    or bound. A ValueError, as a malformed file's error was."""


class PackageJsonError(PackageCorruptError, UntrustedJsonError):
    """A package file's JSON (manifest, runtime graph, weights header) broke a bound of
    ``compiler.json_reader``: a PackageCorruptError, as every refusal of a package file is."""


class RuntimeGraphBoundError(PackageCorruptError, ArithmeticError):
    """A package's runtime graph computes a Python number beyond the bound a shape or index needs
    (integers within +-2**63, finite floats): refused before the operation runs where its size can be
    told in advance (``operator.pow``), otherwise with its result."""


class PackageVersionError(PackageError):
    """A package was written by a newer (or unknown) format version."""


class ToleranceError(KilnError, ValueError):
    """Tolerances name a metric that does not exist, or give a limit it cannot take."""


class SpecialFileError(KilnError, ValueError):
    """A user-named path is a FIFO, device, socket or directory: reading it would block or never end."""


class ValidationDataError(KilnError, ValueError):
    """Recorded validation inputs cannot be used: the message names the file and the field."""


class AccuracyError(KilnError):
    """The compiled model misses its tolerances (after repair, when ``on_accuracy_failure`` is
    ``"repair"``). ``failures``: one reason per missed tolerance, naming the field to change."""

    def __init__(self, message: str, *, failures: list[str]):
        super().__init__(message)
        self.failures = list(failures)


class GenerationError(KilnError, ValueError):
    """A generation request (or a model compiled for generation) is outside what the package was compiled
    for: a prompt longer than its range, more tokens than its cache holds, a batch over its maximum, a
    model without a causal LM head, a padded batch without a pad token. The message names the limit and
    the zoo field (``generation.*``) that sets it."""


class UnsafeProgramError(ExportError, PackageCorruptError):
    """A program archive holds something loading it would unpickle or execute (a pickled weight or
    constant, a custom object, sample inputs that are not plain tensors, an unknown entry): refused
    before torch reads it."""


class UnsafeEngineError(BackendError, PackageCorruptError):
    """An engine asks for something a load must not act on: data outside the engine (ONNX external
    data), or a malformed header. Refused before the engine's library reads it."""


class OpModuleNotAllowedError(KilnError):
    """A package or program needs modules imported (its custom ops, its input/output types) that this
    process does not allow. ``needed``: those modules; ``recorded``: every module the package names."""

    def __init__(self, message: str, *, needed: list[str], recorded: list[str]):
        super().__init__(message)
        self.needed = list(needed)
        self.recorded = list(recorded)


class PackageSignatureError(PackageCorruptError):
    """A signature verification is configured (``KILN_SIGNING_PUBLIC_KEY``, trusted certificates) and a
    package is unsigned, signed by another key, or changed after signing (compiler/package/signing.py)."""


class SigningConfigError(KilnError, ValueError):
    """Signing or verification cannot be done as configured: a key or certificate that is missing or
    not PEM EC, conflicting variables, the retired ``KILN_SIGNING_KEY``, or model-signing not installed.
    The message names the variable and the fix."""


class CudaGraphError(KilnError, ValueError):
    """CUDA graphs were required (``cuda_graphs="on"``) where they cannot run: a CPU device, a backend
    whose engines run outside PyTorch's CUDA stream, or a module the capture check refused."""


class CalibrationError(ValidationDataError):
    """Calibration data for a quantized compile is missing, random without ``allow_random``, or does
    not fit the model's inputs (names, dtypes, shapes, NaN/inf): the message names the field."""


class QuantizationError(KilnError):
    """ONNX Runtime's quantizer failed on a partition (that partition then stays in float precision,
    named in the report)."""


class CalibrationWarning(UserWarning):
    """Calibration went ahead on less than asked for (fewer samples than ``calibration.samples``)."""


class ForeignEngineCodeWarning(UserWarning):
    """An engine's stored native code was refused on this machine, and the engine serves anyway: built for
    another GPU, or compiled against a newer C++ runtime than this process loaded (which crashes a
    process rather than failing). The engine is compiled here from its program, and this machine's own
    native package is built for the loads after it; the message names both sides."""
