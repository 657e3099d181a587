package idempotency

import (
	"crypto/sha256"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// transport is what a transport (the gRPC interceptor, the HTTP middleware,
// ProcessMessage, Execute itself) hands the engine beside the public
// [Call]: how the engine must treat the call's result where the transports
// differ. The zero value is Execute's.
type transport struct {
	// kind names the transport in traces.
	kind Transport
	// namespace prefixes the keys the transport stores, so that keys of
	// different transports never meet in the table: a client's HTTP key can
	// never squat a message ID, nor the other way round. Keys are printable
	// ASCII without spaces (ValidateKey), so a namespace ending in a space
	// cannot be forged by any key. gRPC and Execute share the empty one, as
	// they always have.
	namespace string
	// responseType is the type the call's method declares for its
	// response: a replay decodes the stored response with it. Nil: the type
	// of the stored name (see Result.Response).
	responseType protoreflect.MessageType
	// metadata, when set, is called once Func has succeeded or failed with
	// a final error: what it returns (the handler's headers and trailers, in
	// the transport's encoding) is stored with the result and handed back
	// on replay. An error fails the call, nothing stored.
	metadata func() ([]byte, error)
	// finalCode decides whether a FailedPrecondition that the engine finds
	// at COMMIT (a deferred unique or exclusion constraint of Func's
	// writes; a missing foreign key row never is) is final. Nil: it
	// releases the key.
	finalCode func(codes.Code) bool
	// digest is what derived keys know of the call's proto request (see
	// requestDigest), taken before the handler runs, so that nothing the
	// handler does to its request changes its keys. Unset (hasDigest
	// false): they hash the call's fingerprint.
	digest    [sha256.Size]byte
	hasDigest bool
	// trace is the transport's trace of the call, nil when the store has no
	// tracer.
	trace *callTrace
}

// Namespaces of the transports' keys (see transport.namespace).
const (
	namespaceHTTP    = "http "
	namespaceMessage = "message "
)

// result is what the engine gives a transport: the public Result and the
// metadata that goes with it (stored on replay, recorded on execution).
type result struct {
	Result
	metadata []byte
	// ownAnswer: this run of the handler is the call's answer (its result
	// was stored, or it failed and released the key), so what it set
	// (headers, trailers) goes to the client. Otherwise the answer is a
	// stored row or the engine's own error, which carry none of it.
	ownAnswer bool
}
