package idempotencyconnect

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"

	"connectrpc.com/connect"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
)

// NewHandlerInterceptor returns a connect handler interceptor that runs
// each unary call carrying an idempotency key at most once, using store:
// the call's transaction reaches the handler through
// [idempotency.TxFromContext], its writes and the stored response commit
// together, and a retry gets the stored response (or final error), with
// the headers and trailers the handler set and the trailer
// [idempotency.ReplayedTrailer]. It is [idempotency.UnaryServerInterceptor]
// for connect-go, on the same engine and options: the key is the
// Idempotency-Key header (gRPC's idempotency-key metadata is that header),
// whether a method needs one is decided from the same descriptors
// ((idempotency.v1.method), then protobuf's idempotency_level), and the
// answers are the same codes with the same details (ErrorInfo, RetryInfo,
// PreconditionFailure, BadRequest), in whichever of connect's protocols
// the call came. A key sent through the Connect protocol, gRPC or
// gRPC-Web, or to a grpc-go server with UnaryServerInterceptor on the same
// store and scope, is the same call.
//
// A replay needs no run of the handler in the process: the stored
// response is sent with the method's response type from the global
// registry (as a message of the stored type's name when none is linked
// in, which encodes to the same bytes), behind a wrapper type, as a
// connect.Response's type is fixed at compile time. An interceptor placed
// outside this one that reads the response (resp.Any()) by its Go type,
// *pb.ChargeResponse say, finds the wrapper on a replay: read it as a
// proto.Message (its ProtoReflect is the message's), or install that
// interceptor inside this one.
//
// Streaming calls are not protected: one whose method the option
// annotates, or that carries a key, is refused with CodeUnimplemented
// (STREAMING_UNSUPPORTED) before its handler runs, as
// [idempotency.StreamServerInterceptor] refuses it.
//
// Give it to the handlers with connect.WithInterceptors, after the
// interceptors that authenticate the caller (the scope,
// [idempotency.WithScope], reads their context).
func NewHandlerInterceptor(store *idempotency.Store, opts ...idempotency.ServerOption) (connect.Interceptor, error) {
	s, err := idempotency.NewUnaryServer(store, opts...)
	if err != nil {
		return nil, err
	}
	return &handlerInterceptor{server: s}, nil
}

type handlerInterceptor struct {
	server *idempotency.UnaryServer
}

// replayedMessage is a stored response as connect sends it: a
// connect.Response needs a type known when the code is compiled, and a
// replay's is known when the row is read. connect's codecs encode it
// through ProtoReflect, as the message it holds.
type replayedMessage struct {
	proto.Message
}

func (h *handlerInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		msg, ok := req.Any().(proto.Message)
		if !ok {
			return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("idempotencyconnect: the request of %s is %T, not a proto message", req.Spec().Procedure, req.Any()))
		}
		info, _ := connect.CallInfoForHandlerContext(ctx)
		before := snapshot(info)
		var own connect.AnyResponse
		reply, err := h.server.Serve(ctx, idempotency.UnaryCall{
			Method:    req.Spec().Procedure,
			Request:   msg,
			Metadata:  metadataOf(req.Header()),
			Transport: idempotency.TransportConnect,
		}, func(ctx context.Context) (proto.Message, idempotency.ResponseMetadata, error) {
			before.restore(info) // what an earlier run of the handler set is not this run's
			resp, err := next(ctx, req)
			md := before.changed(info)
			if err != nil {
				var ce *connect.Error
				if errors.As(err, &ce) {
					// An error's metadata: trailers, where gRPC sends them.
					md.Trailer = metadata.Join(md.Trailer, metadataOf(ce.Meta()))
				}
				return nil, md, toGRPC(err)
			}
			own = resp
			md.Header = metadata.Join(md.Header, metadataOf(resp.Header()))
			md.Trailer = metadata.Join(md.Trailer, metadataOf(resp.Trailer()))
			m, ok := resp.Any().(proto.Message)
			if !ok {
				return nil, md, connect.NewError(connect.CodeInternal, fmt.Errorf("idempotencyconnect: the response of %s is %T, not a proto message", req.Spec().Procedure, resp.Any()))
			}
			return m, md, nil
		})
		replayed := reply.Outcome == idempotency.OutcomeReplayed
		if _, asReturned := err.(*grpcError); !replayed && len(reply.Header)+len(reply.Trailer) > 0 && (err == nil || asReturned) {
			// This run's answer, or a call passed through: the handler's
			// response or error as it returned it, with what it set.
			if err != nil {
				return nil, toConnect(err, nil)
			}
			return own, nil
		}
		// A stored answer, the engine's own, or this run's error as the
		// engine rewrote it: what a run of the handler set is taken back,
		// and the answer's headers and trailers are set where the first
		// answer's were (an error's metadata as trailers, as over gRPC).
		before.restore(info)
		var trailer metadata.MD
		if info != nil {
			setHeaders(info.ResponseHeader(), reply.Header)
			setHeaders(info.ResponseTrailer(), reply.Trailer)
		} else {
			trailer = reply.Trailer
		}
		if err != nil {
			return nil, toConnect(err, trailer)
		}
		if !replayed {
			return own, nil // passed through, nothing set
		}
		resp := connect.NewResponse(&replayedMessage{reply.Response})
		if info == nil {
			addHeaders(resp.Header(), reply.Header)
			addHeaders(resp.Trailer(), reply.Trailer)
		}
		return resp, nil
	}
}

func (h *handlerInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (h *handlerInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if err := h.server.RefuseStream(conn.Spec().Procedure, metadataOf(conn.RequestHeader()), nil); err != nil {
			return toConnect(err, nil)
		}
		return next(ctx, conn)
	}
}

// headers is a copy of the response headers and trailers a handler's
// context holds (connect.CallInfo), which connect sends whatever the
// interceptor returns.
type headers struct {
	header, trailer http.Header
}

func snapshot(info connect.CallInfo) headers {
	if info == nil {
		return headers{}
	}
	return headers{info.ResponseHeader().Clone(), info.ResponseTrailer().Clone()}
}

// restore sets info's headers back to h.
func (h headers) restore(info connect.CallInfo) {
	if info == nil {
		return
	}
	reset(info.ResponseHeader(), h.header)
	reset(info.ResponseTrailer(), h.trailer)
}

func reset(dst, to http.Header) {
	for k := range dst {
		delete(dst, k)
	}
	for k, vs := range to {
		dst[k] = append([]string(nil), vs...)
	}
}

// changed is what the handler set in info since h was taken: each key
// whose values it changed, with all its values now (a replay sets them as
// they are: a value the handler replaced is replaced again).
func (h headers) changed(info connect.CallInfo) idempotency.ResponseMetadata {
	if info == nil {
		return idempotency.ResponseMetadata{}
	}
	return idempotency.ResponseMetadata{Header: metadataOf(diff(info.ResponseHeader(), h.header)), Trailer: metadataOf(diff(info.ResponseTrailer(), h.trailer))}
}

// diff is the keys of now whose values are not those of then.
func diff(now, then http.Header) http.Header {
	out := http.Header{}
	for k, vs := range now {
		if !slices.Equal(vs, then[k]) {
			out[k] = vs
		}
	}
	return out
}
