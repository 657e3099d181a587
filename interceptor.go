package idempotency

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency/internal/seam"
)

// MetadataKey is the gRPC metadata key carrying the idempotency key.
const MetadataKey = "idempotency-key"

// ReplayedTrailer is the response trailer set to "true" when the response
// (or final error) was replayed from the store instead of executed: a
// client reads it with grpc.Trailer. A handler may not set it.
const ReplayedTrailer = "idempotency-replayed"

// UnaryServerInterceptor returns a server interceptor that runs each call
// carrying an idempotency key at most once, using store.
//
// A call with a valid key runs in a transaction that the handler reaches
// with [TxFromContext]; its writes, the claim of the key and the stored
// response commit together. Retries of a finished call get the stored
// response (or final error) with the trailer [ReplayedTrailer]; see
// [Store.Execute] for every outcome and codes.go for the status codes.
//
// Which calls need a key is decided per method, once, from the method's
// descriptor: the (idempotency.v1.method) option first (see
// proto/idempotency/v1/idempotency.proto), then protobuf's
// idempotency_level (NO_SIDE_EFFECTS and IDEMPOTENT calls pass through, any
// key ignored), then this interceptor's options: without
// [WithKeyRequired], calls without a key pass through unchanged.
//
// It protects unary calls only; install [StreamServerInterceptor] beside
// it, which refuses the streaming calls that ask for protection.
//
// It panics if store is nil or an option is invalid, as those are
// programming errors found at startup.
func UnaryServerInterceptor(store *Store, opts ...ServerOption) grpc.UnaryServerInterceptor {
	s := &unaryServer{store: store, o: mustServerOptions("UnaryServerInterceptor", store, opts)}
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		msg, isProto := req.(proto.Message)
		md, _ := metadata.FromIncomingContext(ctx)
		call := seam.Call{Method: info.FullMethod, Request: msg, Metadata: md}
		p, err := s.prepare(ctx, call)
		if err == nil && p.passThrough {
			return handler(ctx, req)
		}
		if err == nil && !isProto {
			err = status.Errorf(codes.Internal, "idempotency: request of %s is %T, not a proto message", info.FullMethod, req)
		}
		// The handler's headers and trailers are held back until the
		// call's answer is known, and stored with it.
		hctx, rec := recordMetadata(ctx)
		reply, err := s.protect(hctx, call, p, err, func(ctx context.Context) (proto.Message, seam.Metadata, error) {
			if rec != nil {
				rec.reset()
			}
			resp, err := handler(ctx, req)
			if err != nil {
				return nil, rec.recorded(), err
			}
			m, ok := resp.(proto.Message)
			if !ok {
				return nil, seam.Metadata{}, status.Errorf(codes.Internal, "idempotency: response of %s is %T, not a proto message", info.FullMethod, resp)
			}
			return m, rec.recorded(), nil
		})
		switch {
		case Outcome(reply.Outcome) == OutcomeReplayed:
			if len(reply.Header) > 0 {
				_ = grpc.SetHeader(ctx, reply.Header) // fails only if the stream is already done
			}
			if len(reply.Trailer) > 0 {
				_ = grpc.SetTrailer(ctx, reply.Trailer)
			}
		case rec != nil && (len(reply.Header) > 0 || len(reply.Trailer) > 0):
			// This run's answer: what it set goes with it, less the
			// headers it sent already.
			rec.flush()
		}
		if err != nil {
			return nil, err
		}
		if reply.Response == nil {
			return nil, nil
		}
		return reply.Response, nil
	}
}

// ServerOption configures [UnaryServerInterceptor]. An invalid value makes
// UnaryServerInterceptor panic, naming the option.
type ServerOption func(*serverOptions)

type serverOptions struct {
	scope      func(context.Context) (string, error)
	requireKey bool
	ttl        time.Duration
	final      map[codes.Code]bool
	err        error // the first invalid option
}

func defaultServerOptions() serverOptions {
	return serverOptions{
		scope: func(context.Context) (string, error) { return "", nil },
		ttl:   DefaultTTL,
		final: codeSet(DefaultFinalCodes()),
	}
}

// mustServerOptions applies opts for the constructor named who, panicking
// on a nil store or an invalid option.
func mustServerOptions(who string, store *Store, opts []ServerOption) serverOptions {
	if store == nil {
		panic("idempotency: " + who + ": store is nil")
	}
	o := defaultServerOptions()
	for _, opt := range opts {
		opt(&o)
	}
	if err := o.validate(); err != nil {
		panic(err.Error())
	}
	return o
}

func (o *serverOptions) validate() error {
	switch {
	case o.err != nil:
		return o.err
	case o.scope == nil:
		return fmt.Errorf("idempotency: WithScope: function is nil")
	case o.ttl <= 0:
		return fmt.Errorf("idempotency: WithTTL: must be positive, got %v", o.ttl)
	}
	return nil
}

// DefaultFinalCodes returns the handler error codes that are final by
// default: they mean the request was decided and repeating it gives the
// same answer, so they are stored and replayed: NotFound, AlreadyExists,
// PermissionDenied, FailedPrecondition and OutOfRange.
//
// Every other code releases the key so a retry runs the handler again:
// the transient ones (Unavailable, Aborted, DeadlineExceeded, ...), the
// two that say the request was never processed, InvalidArgument (it failed
// validation) and Unauthenticated, so that the corrected request can be
// sent with the same key, and Unimplemented: during a rolling deploy a
// replica may have a method's stub before its implementation, and the
// retry may reach one that has both.
func DefaultFinalCodes() []codes.Code {
	return []codes.Code{
		codes.NotFound, codes.AlreadyExists, codes.PermissionDenied,
		codes.FailedPrecondition, codes.OutOfRange,
	}
}

func codeSet(cs []codes.Code) map[codes.Code]bool {
	set := make(map[codes.Code]bool, len(cs))
	for _, c := range cs {
		set[c] = true
	}
	return set
}

// WithScope sets the function that names the caller's key scope, usually
// from the authenticated identity an earlier interceptor put in ctx. Keys
// are unique per scope, so two callers can use the same key without seeing
// each other's results. An error from the function rejects the call; return
// a status error (e.g. codes.Unauthenticated) to choose its code, other
// errors become codes.Internal.
//
// Defaults to one scope ("") shared by every caller. That is only safe when
// all callers trust each other: a caller who learns another caller's key
// and request body can read that call's stored response.
func WithScope(f func(ctx context.Context) (string, error)) ServerOption {
	return func(o *serverOptions) { o.scope = f }
}

// WithKeyRequired makes calls without an idempotency key fail with
// codes.InvalidArgument ([ErrMissingKey]) instead of passing through, for
// methods whose descriptor does not decide (the (idempotency.v1.method)
// option's mode decides for the methods it annotates). Without it, the
// default, such calls pass through unprotected, so that a service can take
// keys method by method; the HTTP middleware's default is the other way
// round (see [WithHTTPKeyOptional]), as it protects only the methods it is
// told to.
func WithKeyRequired() ServerOption {
	return func(o *serverOptions) { o.requireKey = true }
}

// WithTTL sets how long finished keys are kept; a retry after that runs the
// call again. Must be positive. Defaults to 24 hours ([DefaultTTL]).
func WithTTL(ttl time.Duration) ServerOption {
	return func(o *serverOptions) { o.ttl = ttl }
}

// WithFinalCodes replaces the set of handler error codes that are final:
// stored and replayed like responses (their business writes still roll
// back). Errors with other codes release the key. codes.OK is not an error
// code and is refused. Use with care: making a transient code such as
// Unavailable final makes the failure permanent for that key. Defaults to
// [DefaultFinalCodes].
func WithFinalCodes(cs ...codes.Code) ServerOption {
	return func(o *serverOptions) {
		for _, c := range cs {
			if c == codes.OK || c > codes.Unauthenticated {
				o.err = fmt.Errorf("idempotency: WithFinalCodes: %v is not an error code", c)
				return
			}
		}
		o.final = codeSet(cs)
	}
}

// grpcPreviousAttempts is the metadata gRPC's own retry policy adds to a
// retry attempt.
const grpcPreviousAttempts = "grpc-previous-rpc-attempts"

// retryMarkers are the metadata that retry interceptors add to a retry
// attempt: go-grpc-middleware v2's, and v1's, which many copies of it keep.
// A retry loop that adds none cannot be told from a new call.
var retryMarkers = []string{retry.AttemptMetadataKey, "x-retry-attempty"}

// isRetryAttempt reports whether the client marked the call as a retry, so
// the engine looks for a stored result before anything else.
func isRetryAttempt(md metadata.MD) bool {
	return len(md.Get(grpcPreviousAttempts)) > 0 || isMarkedRetry(md)
}

// clientAttempt is which of its client's attempts a call is, by the marks
// gRPC's retry policy and the retry interceptors set (for traces only): 1
// for a call without one.
func clientAttempt(md metadata.MD) int {
	n := 1
	for _, k := range append([]string{grpcPreviousAttempts}, retryMarkers...) {
		if v := md.Get(k); len(v) > 0 {
			if before, err := strconv.Atoi(v[0]); err == nil && before > 0 && before < math.MaxInt32 {
				n = max(n, before+1)
			}
		}
	}
	return n
}

// isMarkedRetry reports whether md carries a retry interceptor's marker.
func isMarkedRetry(md metadata.MD) bool {
	for _, k := range retryMarkers {
		if len(md.Get(k)) > 0 {
			return true
		}
	}
	return false
}

// binaryMetadataKey is the binary form of [MetadataKey]. To gRPC it is
// another header, so a call carrying it is refused wherever it is seen
// (client and server, beside a text key or not): ignoring it would leave
// the call unprotected, and honouring it beside a text key would leave two
// keys for one call.
const binaryMetadataKey = MetadataKey + "-bin"

func binaryKey() error {
	return invalidKey(binaryMetadataKey, fmt.Sprintf("the key was sent as binary metadata %s; send it as the text metadata %s", binaryMetadataKey, MetadataKey))
}

// missingKey is ErrMissingKey naming where the key is expected.
func missingKey(pol methodPolicy) error {
	if pol.keyField != nil {
		return ErrMissingKey.with(fmt.Sprintf("send it in the %s metadata or the request field %s", MetadataKey, pol.keyPath), nil).about(pol.keyPath)
	}
	return ErrMissingKey.with(fmt.Sprintf("send it in the %s metadata", MetadataKey), nil).about(MetadataKey)
}

// keyFromIncoming returns the key of an incoming call's metadata. ok is
// false when the call has none; more than one value, or an invalid one, is
// an error.
func keyFromIncoming(md metadata.MD) (key string, ok bool, err error) {
	if len(md.Get(binaryMetadataKey)) > 0 {
		return "", false, binaryKey()
	}
	vals := md.Get(MetadataKey)
	switch len(vals) {
	case 0:
		return "", false, nil
	case 1:
		if err := ValidateKey(vals[0]); err != nil {
			return "", false, keyError(err, MetadataKey, "")
		}
		return vals[0], true, nil
	default:
		return "", false, invalidKey(MetadataKey, fmt.Sprintf("%d values sent, exactly one is allowed", len(vals)))
	}
}
