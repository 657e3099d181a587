package idempotencyconnect

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/unary"
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
	s, err := unary.NewServer(store, opts...)
	if err != nil {
		return nil, err
	}
	return &handlerInterceptor{server: s}, nil
}

type handlerInterceptor struct {
	server *unary.Server
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
		reply, err := h.server.Serve(ctx, unary.Call{
			Method:    req.Spec().Procedure,
			Request:   msg,
			Metadata:  metadataOf(req.Header()),
			Transport: idempotency.TransportConnect,
		}, func(ctx context.Context) (proto.Message, unary.Metadata, error) {
			before.restore(info) // what an earlier run of the handler set is not this run's
			resp, err := next(ctx, req)
			// The replay marker is the layer's to set: a handler's is taken
			// out wherever it put it, as gRPC's SetTrailer refuses it.
			before.unmark(info)
			var ce *connect.Error
			if err != nil && errors.As(err, &ce) && !connect.IsWireError(ce) {
				ce.Meta().Del(idempotency.ReplayedTrailer)
			}
			if resp != nil {
				resp.Header().Del(idempotency.ReplayedTrailer)
				resp.Trailer().Del(idempotency.ReplayedTrailer)
			}
			md, pl := before.changed(info)
			pl.Raw = rawBinary(info, resp, ce)
			if err != nil {
				if ce != nil && !connect.IsWireError(ce) {
					// An error's metadata: trailers, where gRPC sends them
					// (connect sends none of a downstream's error passed on,
					// and neither does a replay).
					md.Trailer = metadata.Join(md.Trailer, metadataOf(ce.Meta()))
				}
				md.Adapter = pl.encode()
				return nil, md, toGRPC(err)
			}
			own = resp
			md.Header = metadata.Join(md.Header, metadataOf(resp.Header()))
			md.Trailer = metadata.Join(md.Trailer, metadataOf(resp.Trailer()))
			md.Adapter = pl.encode()
			m, ok := resp.Any().(proto.Message)
			if !ok {
				return nil, md, connect.NewError(connect.CodeInternal, fmt.Errorf("idempotencyconnect: the response of %s is %T, not a proto message", req.Spec().Procedure, resp.Any()))
			}
			return m, md, nil
		})
		replayed := reply.Outcome == idempotency.OutcomeReplayed
		ownMetadata := len(reply.Header)+len(reply.Trailer)+len(reply.Adapter) > 0
		if _, asReturned := err.(*grpcError); !replayed && ownMetadata && (err == nil || asReturned) {
			// This run's answer, or a call passed through: the handler's
			// response or error as it returned it, with what it set.
			if err != nil {
				return nil, toConnect(err, nil)
			}
			return own, nil
		}
		// A stored answer, the engine's own, or this run's error as the
		// engine rewrote it: what a run of the handler set is taken back,
		// and the answer's headers and trailers are put back where the
		// first answer had them.
		before.restore(info)
		p := place(info, reply.Metadata, err != nil)
		if err != nil {
			return nil, toConnect(err, p.errorMeta)
		}
		if !replayed {
			return own, nil // passed through, nothing set
		}
		resp := connect.NewResponse(&replayedMessage{reply.Response})
		mergeHeaders(resp.Header(), p.header)
		mergeHeaders(resp.Trailer(), p.trailer)
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

// placement is where connect had the values of a response's headers and
// trailers, kept beside them (unary.Metadata.Adapter): of each key, how
// many of its first values the handler's context (connect.CallInfo) held,
// the others being the response's, or an error's metadata; and the keys
// the handler deleted from its context.
type placement struct {
	Header         map[string]int `json:"h,omitempty"`
	Trailer        map[string]int `json:"t,omitempty"`
	DeletedHeader  []string       `json:"dh,omitempty"`
	DeletedTrailer []string       `json:"dt,omitempty"`
	// Raw is the binary (-bin) keys whose values the handler wrote
	// otherwise than in base64, kept and sent again as written.
	Raw []string `json:"raw,omitempty"`
}

func (p placement) encode() []byte {
	if len(p.Header)+len(p.Trailer)+len(p.DeletedHeader)+len(p.DeletedTrailer)+len(p.Raw) == 0 {
		return nil
	}
	b, _ := json.Marshal(p)
	return b
}

// changed is what the handler did to info since h was taken: each key
// whose values it changed, with all its values now (a replay sets them as
// they are: a value the handler replaced is replaced again), and each key
// it deleted.
func (h headers) changed(info connect.CallInfo) (unary.Metadata, placement) {
	var p placement
	if info == nil {
		return unary.Metadata{}, p
	}
	header, dh := diff(info.ResponseHeader(), h.header)
	trailer, dt := diff(info.ResponseTrailer(), h.trailer)
	md := unary.Metadata{Header: metadataOf(header), Trailer: metadataOf(trailer)}
	p.Header, p.Trailer = counts(md.Header), counts(md.Trailer)
	p.DeletedHeader, p.DeletedTrailer = dh, dt
	return md, p
}

func counts(md metadata.MD) map[string]int {
	if len(md) == 0 {
		return nil
	}
	n := make(map[string]int, len(md))
	for k, vs := range md {
		n[k] = len(vs)
	}
	return n
}

// diff is the keys of now whose values are not those of then, and the
// keys of then that now has not (lower case).
func diff(now, then http.Header) (changed http.Header, deleted []string) {
	changed = http.Header{}
	for k, vs := range now {
		if !slices.Equal(vs, then[k]) {
			changed[k] = vs
		}
	}
	for k := range then {
		if _, ok := now[k]; !ok {
			deleted = append(deleted, strings.ToLower(k))
		}
	}
	slices.Sort(deleted)
	return changed, deleted
}

// unmark takes out of info a replay marker that was not there when h was
// taken.
func (h headers) unmark(info connect.CallInfo) {
	if info == nil {
		return
	}
	if h.header.Get(idempotency.ReplayedTrailer) == "" {
		info.ResponseHeader().Del(idempotency.ReplayedTrailer)
	}
	if h.trailer.Get(idempotency.ReplayedTrailer) == "" {
		info.ResponseTrailer().Del(idempotency.ReplayedTrailer)
	}
}

// rawBinary is the binary (-bin) keys, lower case, of which a value the
// handler set (in its context, on its response or its error) is not
// base64.
func rawBinary(info connect.CallInfo, resp connect.AnyResponse, ce *connect.Error) []string {
	var hs []http.Header
	if info != nil {
		hs = append(hs, info.ResponseHeader(), info.ResponseTrailer())
	}
	if resp != nil {
		hs = append(hs, resp.Header(), resp.Trailer())
	}
	if ce != nil {
		hs = append(hs, ce.Meta())
	}
	var raw []string
	for _, h := range hs {
		for k, vs := range h {
			k = strings.ToLower(k)
			if !strings.HasSuffix(k, "-bin") || slices.Contains(raw, k) {
				continue
			}
			for _, v := range vs {
				if _, err := connect.DecodeBinaryHeader(v); err != nil {
					raw = append(raw, k)
					break
				}
			}
		}
	}
	slices.Sort(raw)
	return raw
}

// placed is a stored answer's headers and trailers that do not go in the
// handler's context: the response's, or an error's metadata.
type placed struct {
	header, trailer, errorMeta http.Header
}

// place puts a stored answer's headers and trailers back where connect had
// them on its first answer: the handler's context's values into info (its
// deletions too), the others on the response, or in an error's metadata.
// An answer stored through another framework (no placement) has its
// headers on the response (in the context, for an error) and its trailers
// on the response (in the error's metadata, for an error): where gRPC
// sends them.
func place(info connect.CallInfo, md unary.Metadata, isError bool) placed {
	var p placement
	if len(md.Adapter) > 0 {
		_ = json.Unmarshal(md.Adapter, &p) // a placement that does not parse puts nothing in the context
	}
	out := placed{header: http.Header{}, trailer: http.Header{}, errorMeta: http.Header{}}
	value := func(k, v string) string {
		if slices.Contains(p.Raw, k) {
			return v // as the handler wrote it
		}
		return headerValue(k, v)
	}
	// split sets the first inContext values of key k in ctx (when there is
	// a context), replacing what it held, and adds the others to rest.
	split := func(k string, vs []string, inContext int, ctx, rest http.Header) {
		n := min(inContext, len(vs))
		if ctx == nil {
			n = 0
		}
		ck := http.CanonicalHeaderKey(k)
		if n > 0 {
			ctx[ck] = nil
			for _, v := range vs[:n] {
				ctx[ck] = append(ctx[ck], value(k, v))
			}
		}
		for _, v := range vs[n:] {
			rest[ck] = append(rest[ck], value(k, v))
		}
	}
	var ctxHeader, ctxTrailer http.Header
	if info != nil {
		ctxHeader, ctxTrailer = info.ResponseHeader(), info.ResponseTrailer()
		for _, k := range p.DeletedHeader {
			ctxHeader.Del(k)
		}
		for _, k := range p.DeletedTrailer {
			ctxTrailer.Del(k)
		}
	}
	headerRest := out.header
	if isError {
		headerRest = out.errorMeta // no context to put them in: with the error's metadata
	}
	for k, vs := range md.Header {
		inContext := p.Header[k]
		if isError {
			inContext = len(vs) // an error has no response headers
		}
		split(k, vs, inContext, ctxHeader, headerRest)
	}
	trailerRest := out.trailer
	if isError {
		trailerRest = out.errorMeta
	}
	for k, vs := range md.Trailer {
		split(k, vs, p.Trailer[k], ctxTrailer, trailerRest)
	}
	return out
}
