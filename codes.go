package idempotency

import (
	"errors"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"
)

// ErrorDomain is the domain of the google.rpc.ErrorInfo detail attached to
// every error this package produces, so clients can tell them apart from a
// handler's own errors with the same code.
const ErrorDomain = "github.com/exactlyonce/idempotency"

// Sentinel errors, one per outcome of the idempotency layer itself. Test for
// them with errors.Is on the server; on the client, where errors arrive as
// gRPC statuses, use [IsInProgress], [IsKeyReused] and [RetryDelay].
//
//	outcome                                 code                details
//	key held by a call still running        Aborted             ErrorInfo, RetryInfo
//	key reused with another request         FailedPrecondition  ErrorInfo, PreconditionFailure
//	key malformed or sent twice             InvalidArgument     ErrorInfo, BadRequest
//	key required but missing                InvalidArgument     ErrorInfo, BadRequest
//	database unreachable or failing         Unavailable         ErrorInfo, RetryInfo
//	database aborted the transaction        Aborted             RetryInfo
//	retry chained outside the key (client)  Internal            ErrorInfo
//	outgoing call of an ended call (client) Internal            ErrorInfo
//	unnamed outgoing call in a call (client) Internal           ErrorInfo
//	attempt cut by its timeout (client)     DeadlineExceeded    ErrorInfo
//	key or annotation on a streaming call   Unimplemented       ErrorInfo
//
// Every status of this package that a retry can get past (Unavailable,
// Aborted) carries a RetryInfo of the store's [WithSuggestedRetryDelay] as
// [UnaryServerInterceptor] (or package unary's Server) sends it; the HTTP middleware
// sends the same delay as Retry-After, rounded up to whole seconds and at
// least 1. An error of [Store.Execute] or [Store.ProcessMessage] carries
// one only for [ErrInProgress].
var (
	// ErrInProgress: another call with the same key is running and did not
	// finish within the wait. Retry later with the same key.
	ErrInProgress = &Error{code: codes.Aborted, reason: "KEY_IN_PROGRESS", msg: "a call with this idempotency key is still in progress; retry later with the same key"}
	// ErrKeyReused: the key already belongs to a different request or method.
	// Retrying cannot succeed; the caller must use a new key.
	ErrKeyReused = &Error{code: codes.FailedPrecondition, reason: "KEY_REUSED", msg: "idempotency key was already used with a different request"}
	// ErrInvalidKey: the key is empty, too long, has characters outside
	// printable ASCII, or was sent more than once. The BadRequest detail
	// names where the key came from (the metadata key, a request field).
	ErrInvalidKey = &Error{code: codes.InvalidArgument, reason: "INVALID_KEY", msg: "invalid idempotency key"}
	// ErrMissingKey: the method requires a key and the call had none.
	ErrMissingKey = &Error{code: codes.InvalidArgument, reason: "MISSING_KEY", msg: "idempotency key is required for this method"}
	// ErrStoreUnavailable: the database failed while the key was being
	// claimed, or while the call ran or its result was stored. Either nothing
	// ran, or the outcome is unknown (the connection died during COMMIT). A
	// retry with the same key is safe: it replays the result if the call
	// committed, and runs it otherwise.
	// Over gRPC it carries a RetryInfo, as every retryable status of this
	// package does; a client should keep retrying for longer than a
	// failover takes (see [WithRetryBudget]).
	ErrStoreUnavailable = &Error{code: codes.Unavailable, reason: "STORE_UNAVAILABLE", msg: "key store unavailable"}
	// ErrChainOrder is returned by the client interceptor for a retry
	// attempt that has no key: the retry interceptor runs before (outside)
	// the key interceptor, so each attempt would get a new key and could run
	// the operation again. Put the key interceptor first. Only retries that
	// say so are recognised: those of go-grpc-middleware's retry
	// interceptor (v2's x-retry-attempt, v1's x-retry-attempty).
	ErrChainOrder = &Error{code: codes.Internal, reason: "CHAIN_ORDER", msg: "retry attempt without an idempotency key: chain idempotency.UnaryClientInterceptor before the retry interceptor"}
	// ErrStreamingUnsupported: the call is a streaming one, which this
	// package does not protect, and it asks for protection (its method is
	// annotated, or it carries a key); see [StreamServerInterceptor] and
	// [CheckStreamingMethods]. Retrying cannot succeed.
	ErrStreamingUnsupported = &Error{code: codes.Unimplemented, reason: "STREAMING_UNSUPPORTED", msg: "idempotency keys are not supported on streaming methods"}
	// ErrAttemptTimeout is returned by the client interceptor
	// ([UnaryClientInterceptor]) for an attempt it cut because it ran past
	// [WithPerAttemptTimeout]; the interceptor retries it with the same key
	// within its budget. The server rolls a cut call back, so a handler
	// slower than the timeout never succeeds: raise the option, or leave
	// it unset so that the call's deadline alone bounds each attempt.
	ErrAttemptTimeout = &Error{code: codes.DeadlineExceeded, reason: "ATTEMPT_TIMEOUT", msg: "the attempt ran past WithPerAttemptTimeout and was cut; " +
		"raise the option, or leave it unset so that the call's deadline alone bounds each attempt"}
)

// suggestedDelay is the RetryInfo delay of a retryable outcome; set false
// leaves the RetryInfo out (but for ErrInProgress, which always has one).
type suggestedDelay struct {
	d   time.Duration
	set bool
}

// retryableCode reports whether a client retries a status of code c with
// the same key: the codes whose statuses of this package carry RetryInfo,
// and ResourceExhausted (see [UnaryClientInterceptor]).
func retryableCode(c codes.Code) bool {
	return c == codes.Unavailable || c == codes.Aborted || c == codes.ResourceExhausted
}

// withSuggestedDelay returns err with delay in its RetryInfo when err is a
// retryable outcome of this package that no delay was chosen for yet;
// anything else, a handler's own status included, is returned as it is.
func withSuggestedDelay(err error, delay time.Duration) error {
	switch e := err.(type) {
	case *Error:
		if retryableCode(e.code) && !e.retryDelay.set {
			c := *e
			c.retryDelay = suggestedDelay{delay, true}
			return &c
		}
	case *dbFailure:
		if retryableCode(e.code) && !e.retryDelay.set {
			c := *e
			c.retryDelay = suggestedDelay{delay, true}
			return &c
		}
	}
	return err
}

// Error is an outcome of the idempotency layer, convertible to a gRPC status
// with [status.FromError]. Every Error is one of the sentinels above,
// possibly with more detail; errors.Is matches it against its sentinel.
type Error struct {
	code   codes.Code
	reason string
	msg    string

	detail     string         // appended to msg
	cause      error          // underlying cause, for logs; never sent to the client
	retryDelay suggestedDelay // RetryInfo, for a retryable code as sent
	// subject is the offending field (BadRequest) or key
	// (PreconditionFailure); empty leaves that detail out.
	subject string
}

func (e *Error) with(detail string, cause error) *Error {
	c := *e
	c.detail, c.cause = detail, cause
	return &c
}

// about returns a copy of e naming subject, the field or key at fault.
func (e *Error) about(subject string) *Error {
	c := *e
	c.subject = subject
	return &c
}

// inProgress is ErrInProgress suggesting that clients retry after delay.
func inProgress(detail string, delay time.Duration) *Error {
	e := ErrInProgress.with(detail, nil)
	e.retryDelay = suggestedDelay{delay, true}
	return e
}

// Error implements error.
func (e *Error) Error() string {
	s := "idempotency: " + e.msg
	if e.detail != "" {
		s += ": " + e.detail
	}
	if e.cause != nil {
		s += ": " + e.cause.Error()
	}
	return s
}

// Code returns the gRPC status code of the outcome.
func (e *Error) Code() codes.Code { return e.code }

// Unwrap returns the underlying cause, such as a database error.
func (e *Error) Unwrap() error { return e.cause }

// Is reports whether target is the sentinel this error was made from.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.reason == e.reason
}

// GRPCStatus returns the status sent to the client: code, message and
// details. The cause is not included; it may name internal systems.
func (e *Error) GRPCStatus() *status.Status {
	msg := e.msg
	if e.detail != "" {
		msg += ": " + e.detail
	}
	st := status.New(e.code, msg)
	details := []protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: e.reason, Domain: ErrorDomain}}
	if e.retryDelay.set || e.reason == ErrInProgress.reason {
		details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(e.retryDelay.d)})
	}
	switch e.reason {
	case ErrKeyReused.reason:
		details = append(details, &errdetails.PreconditionFailure{Violations: []*errdetails.PreconditionFailure_Violation{{
			Type:        "IDEMPOTENCY_KEY",
			Subject:     e.subject,
			Description: "the key was first used with a different method or request body; use a new key for a new request",
		}}})
	case ErrInvalidKey.reason, ErrMissingKey.reason:
		if e.subject != "" {
			details = append(details, &errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{
				Field:       e.subject,
				Description: msg,
			}}})
		}
	}
	for _, d := range details {
		if s, err := st.WithDetails(d); err == nil {
			st = s
		}
	}
	return st
}

// IsInProgress reports whether err (a server-side error or a status received
// by a client) says the key is held by a call still running: retry later with
// the same key.
func IsInProgress(err error) bool { return hasReason(err, ErrInProgress.reason) }

// IsKeyReused reports whether err says the key was already used for another
// request: do not retry; a new request needs a new key.
func IsKeyReused(err error) bool { return hasReason(err, ErrKeyReused.reason) }

// RetryDelay returns the delay a server suggested in a google.rpc.RetryInfo
// detail of err, if there is one.
func RetryDelay(err error) (time.Duration, bool) {
	st, ok := status.FromError(err)
	if !ok {
		return 0, false
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay() != nil {
			return ri.GetRetryDelay().AsDuration(), true
		}
	}
	return 0, false
}

func hasReason(err error, reason string) bool {
	var e *Error
	if errors.As(err, &e) {
		return e.reason == reason
	}
	st, ok := status.FromError(err)
	if !ok {
		return false
	}
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetDomain() == ErrorDomain {
			return ei.GetReason() == reason
		}
	}
	return false
}

// Final marks an error returned by a [Func] as the call's final outcome:
// the transaction's business writes roll back, but the key commits with the
// error (as a google.rpc.Status, details included), and every retry gets the
// same error without running Func again. Errors not marked final release
// the key, so a retry runs Func again. Final(nil) is nil.
//
// The status stored is the one a gRPC server sends for err: err's own
// (status.FromError: that of a status it wraps, with err's whole text as
// the message), Canceled or DeadlineExceeded for a context's error, and
// Unknown with err's text for any other; an error whose status says OK is
// stored as Unknown. Every caller of the key gets that status, the first
// as every replay: [Store.Execute] returns final errors still marked (so
// [IsFinal] tells them from errors that released the key), each reading as
// the stored status through status.FromError, with its message as its
// text.
func Final(err error) error {
	if err == nil {
		return nil
	}
	return &finalError{err: err}
}

// IsFinal reports whether err is a final outcome made with [Final]: it is
// stored with the key, and retrying with the same key returns it again.
func IsFinal(err error) bool {
	var f *finalError
	return errors.As(err, &f)
}

// unwrapFinal removes the [Final] mark: the error fn returned, or the
// stored status error of an answer (see storedFinal).
func unwrapFinal(err error) error {
	var f *finalError
	if errors.As(err, &f) {
		return f.err
	}
	return err
}

// finalError is an error marked [Final]. stored: err is the status error
// of the status stored for its key, as the engine answers every caller of
// the key (see storedFinal).
type finalError struct {
	err    error
	stored bool
}

// storedFinal is the answer of a key that stores st as its final error,
// the same for the call that stored it as for every replay.
func storedFinal(st *status.Status) error {
	if st.Code() == codes.OK {
		// Stored before an OK status was refused (see finalStatus).
		p := st.Proto()
		p.Code = int32(codes.Unknown)
		st = status.FromProto(p)
	}
	return &finalError{err: st.Err(), stored: true}
}

// Error is the error's text: a stored status's message, as a client of
// the key reads it, whatever the handler's error said of itself.
func (f *finalError) Error() string {
	if f.stored {
		return status.Convert(f.err).Message()
	}
	return f.err.Error()
}

func (f *finalError) Unwrap() error { return f.err }

// GRPCStatus is the status the error is stored and answered as (see
// finalStatus), rather than what status.FromError makes of a wrapper: its
// text as the message.
func (f *finalError) GRPCStatus() *status.Status { return finalStatus(f.err) }

// finalStatus is the status a final error is stored as, and every caller
// of its key answered with: what a gRPC server sends for err (see Final),
// with a message that protobuf can encode (see sanitizeStatus).
func finalStatus(err error) *status.Status {
	st, ok := status.FromError(err)
	if !ok {
		st = status.FromContextError(err)
	}
	p := st.Proto()
	if p.GetCode() == int32(codes.OK) {
		p.Code = int32(codes.Unknown) // an error, whatever its status says
	}
	return status.FromProto(sanitizeStatus(p))
}

// contextError is the caller's own cancellation or deadline: errors.Is
// matches the context error, and gRPC sends Canceled or DeadlineExceeded.
type contextError struct{ err error }

func (e contextError) Error() string              { return "idempotency: " + e.err.Error() }
func (e contextError) Unwrap() error              { return e.err }
func (e contextError) GRPCStatus() *status.Status { return status.FromContextError(e.err) }
