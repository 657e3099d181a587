package idempotencyconnect

import (
	"errors"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/exactlyonce/idempotency"
)

// grpcError is an error of connect's as the idempotency engine reads it:
// a gRPC status with its code, message and details, so that the engine
// decides whether it is final, stores it so, and a retry decides whether
// to retry it. The connect error itself is what the caller gets back.
type grpcError struct {
	err error // the *connect.Error, or another error a handler returned
	st  *status.Status
}

func (e *grpcError) Error() string              { return e.err.Error() }
func (e *grpcError) Unwrap() error              { return e.err }
func (e *grpcError) GRPCStatus() *status.Status { return e.st }

// toGRPC wraps err, as connect-go sends it, so that it reads as the gRPC
// status a gRPC client of the same handler would get: connect's codes are
// gRPC's, its details are google.protobuf.Any. An error that is not a
// *connect.Error is what connect sends as CodeUnknown, unless it carries
// a gRPC status of its own (an idempotency error, a pgx error the engine
// classifies): then that is kept as it is.
func toGRPC(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return err
	}
	p := &spb.Status{Code: int32(ce.Code()), Message: ce.Message()}
	for _, d := range ce.Details() {
		p.Details = append(p.Details, &anypb.Any{TypeUrl: "type.googleapis.com/" + d.Type(), Value: d.Bytes()})
	}
	return &grpcError{err: err, st: status.FromProto(p)}
}

// toConnect is the connect error for err, as the engine returned it: the
// handler's own error as the handler returned it; a gRPC status error (an
// idempotency outcome, a stored final error) with its code, message and
// details, and trailer as its metadata (which connect sends as gRPC's
// trailers, in the headers of the Connect protocol's unary answer), with
// meta as its metadata; any
// other error as it is, which connect answers as it answers a handler's
// (a context's error with its code, others Unknown).
func toConnect(err error, meta http.Header) error {
	if ge, own := err.(*grpcError); own {
		return ge.err // the handler's own error, as it returned it
	}
	st, isStatus := status.FromError(err)
	if !isStatus {
		return err
	}
	code := connect.Code(st.Code())
	if st.Code() == codes.OK || code > connect.CodeUnauthenticated {
		code = connect.CodeUnknown
	}
	ce := connect.NewError(code, errors.New(st.Message()))
	for _, d := range st.Proto().GetDetails() {
		if detail, err := connect.NewErrorDetail(d); err == nil {
			ce.AddDetail(detail)
		}
	}
	mergeHeaders(ce.Meta(), meta)
	var inner *connect.Error
	if errors.As(err, &inner) {
		// A connect error the layer added to (the attempts a client made):
		// its metadata goes with it.
		for k, vs := range inner.Meta() {
			ce.Meta()[k] = append(ce.Meta()[k], vs...)
		}
	}
	return ce
}

// metadataOf is an HTTP header as gRPC metadata: lower-case keys, and the
// values of binary keys (-bin) as bytes, which connect keeps in base64 and
// gRPC as they are, so that a key's headers stored through one framework
// are the same bytes through the other.
func metadataOf(h http.Header) metadata.MD {
	md := make(metadata.MD, len(h))
	for k, vs := range h {
		k = strings.ToLower(k)
		for _, v := range vs {
			if strings.HasSuffix(k, "-bin") {
				if b, err := connect.DecodeBinaryHeader(v); err == nil {
					v = string(b)
				}
			}
			md[k] = append(md[k], v)
		}
	}
	return md
}

// mergeHeaders adds the values of src to dst.
func mergeHeaders(dst, src http.Header) {
	for k, vs := range src {
		dst[k] = append(dst[k], vs...)
	}
}

func headerValue(k, v string) string {
	if strings.HasSuffix(k, "-bin") {
		return connect.EncodeBinaryHeader([]byte(v))
	}
	return v
}

// IsKeyReused reports whether err, a connect error of a call, says that
// its key was used before with another request (FailedPrecondition,
// ErrorInfo KEY_REUSED): the idempotency layer's answer, not a handler's
// own FailedPrecondition. See [idempotency.IsKeyReused].
func IsKeyReused(err error) bool { return idempotency.IsKeyReused(statusError(err)) }

// IsInProgress reports whether err says that the call of its key was still
// running (Aborted, ErrorInfo KEY_IN_PROGRESS). See
// [idempotency.IsInProgress].
func IsInProgress(err error) bool { return idempotency.IsInProgress(statusError(err)) }

// RetryDelay returns the delay the server suggested in err's RetryInfo.
// See [idempotency.RetryDelay].
func RetryDelay(err error) (time.Duration, bool) { return idempotency.RetryDelay(statusError(err)) }

// statusError is err as a gRPC status error.
func statusError(err error) error {
	if g := toGRPC(err); g != nil {
		return g
	}
	return nil
}
