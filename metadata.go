package idempotency

import (
	"context"
	"errors"
	"strings"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/exactlyonce/idempotency/internal/seam"
)

// MaxStoredMetadata is the most header and trailer data, in bytes of keys
// and values, that a handler may set on a call whose result is stored. A
// call whose handler sets more fails with codes.Internal and nothing is
// stored: a replay must give the client what the first call gave it.
const MaxStoredMetadata = 16 << 10

// recordingStream records the headers and trailers a handler sets, so they
// can be stored with the call's result. It holds them back from the real
// stream until the call's outcome is known (flush): a run of the handler
// whose transaction rolls back, and whose key then turns out to hold
// another call's result, must not have sent its own. Headers the handler
// sends explicitly (SendHeader) go at once.
type recordingStream struct {
	grpc.ServerTransportStream
	mu              sync.Mutex
	header, trailer metadata.MD
	headerSent      bool
}

// recordMetadata returns ctx with its transport stream wrapped by a
// recorder, or nil when ctx has no stream (a direct call of the
// interceptor, as in tests).
func recordMetadata(ctx context.Context) (context.Context, *recordingStream) {
	st := grpc.ServerTransportStreamFromContext(ctx)
	if st == nil {
		return ctx, nil
	}
	r := &recordingStream{ServerTransportStream: st}
	// An interceptor outside may have sent the headers already; then the
	// handler's must fail as they would without this recorder, not be
	// recorded and lost. grpc-go's stream refuses a new send compressor
	// once the headers are sent; setting the one it has asks without
	// changing anything. (Setting a header would: any header makes an
	// error response a separate header frame, which gRPC's retry policy
	// does not retry.)
	if c, ok := st.(sendCompressor); ok && c.SetSendCompress(c.SendCompress()) != nil {
		r.headerSent = true
	}
	return grpc.NewContextWithServerTransportStream(ctx, r), r
}

// sendCompressor is the part of grpc-go's server stream that tells whether
// its headers were sent.
type sendCompressor interface {
	SendCompress() string
	SetSendCompress(name string) error
}

// reset forgets what an earlier run of the handler set.
func (r *recordingStream) reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.headerSent {
		r.header = nil
	}
	r.trailer = nil
}

func (r *recordingStream) SetHeader(md metadata.MD) error {
	if err := refuseUnstorable(md); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.headerSent {
		return r.ServerTransportStream.SetHeader(md) // reports the error the stream gives
	}
	r.header = metadata.Join(r.header, md)
	return nil
}

func (r *recordingStream) SendHeader(md metadata.MD) error {
	if err := refuseUnstorable(md); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	err := r.ServerTransportStream.SendHeader(metadata.Join(r.header, md))
	if err == nil {
		r.header = metadata.Join(r.header, md)
		r.headerSent = true
	}
	return err
}

func (r *recordingStream) SetTrailer(md metadata.MD) error {
	if err := refuseUnstorable(md); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.trailer = metadata.Join(r.trailer, md)
	return nil
}

// flush passes what the handler set on to the real stream: the call ran,
// or failed, and its own headers and trailers go with its answer.
func (r *recordingStream) flush() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.header) > 0 && !r.headerSent {
		_ = r.ServerTransportStream.SetHeader(r.header)
	}
	if len(r.trailer) > 0 {
		_ = r.ServerTransportStream.SetTrailer(r.trailer)
	}
}

// recorded is what the handler set, for storage; nothing on a nil
// recorder (no stream to record).
func (r *recordingStream) recorded() seam.Metadata {
	if r == nil {
		return seam.Metadata{}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return seam.Metadata{Header: r.header.Copy(), Trailer: r.trailer.Copy()}
}

// encodeResponseMetadata returns a handler's headers and trailers in their
// stored form. A key the handler may not set, or more than
// MaxStoredMetadata, is an error: the call fails, nothing stored.
func encodeResponseMetadata(md seam.Metadata) ([]byte, error) {
	if err := refuseUnstorable(md.Header); err != nil {
		return nil, err
	}
	if err := refuseUnstorable(md.Trailer); err != nil {
		return nil, err
	}
	b, size := encodeMD(nil, 1, md.Header, 0)
	b, size = encodeMD(b, 2, md.Trailer, size)
	if len(md.Adapter) > 0 {
		b = protowire.AppendBytes(protowire.AppendTag(b, 3, protowire.BytesType), md.Adapter)
		size += len(md.Adapter)
	}
	if size > MaxStoredMetadata {
		return nil, status.Errorf(codes.Internal, "idempotency: the handler set %d bytes of headers and trailers; at most %d (MaxStoredMetadata) can be stored for replay", size, MaxStoredMetadata)
	}
	return b, nil
}

// storable reports whether a key the handler may set on a keyed call: every
// key it sets is stored and replayed, so that the first answer and its
// replays carry the same headers, but for HTTP/2 pseudo-headers and the
// trailer that marks a replay, which the handler may not set at all.
func storable(key string) bool {
	return !strings.HasPrefix(key, ":") && key != ReplayedTrailer
}

// refuseUnstorable is the error for metadata a handler may not set on a
// keyed call, nil when md holds none.
func refuseUnstorable(md metadata.MD) error {
	for key := range md {
		if !storable(strings.ToLower(key)) {
			return status.Errorf(codes.Internal, "idempotency: the handler set the metadata %q, which a keyed call cannot store for its replays; nothing of this SetHeader, SendHeader or SetTrailer was set", key)
		}
	}
	return nil
}

// The stored form, in protobuf's wire format: field 1 holds the header
// entries and field 2 the trailer entries, each entry a key (field 1) and
// its values (field 2, repeated), in the order they were set.
func encodeMD(b []byte, field protowire.Number, md metadata.MD, size int) ([]byte, int) {
	for key, values := range md {
		if !storable(key) {
			continue
		}
		for _, v := range values {
			size += len(key) + len(v)
		}
		b = appendEntry(b, field, key, values)
	}
	return b, size
}

// appendEntry appends, as field, an entry of a key (field 1) and its values
// (field 2, repeated): the stored form of a header, for gRPC and HTTP.
func appendEntry(b []byte, field protowire.Number, key string, values []string) []byte {
	entry := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), key)
	for _, v := range values {
		entry = protowire.AppendString(protowire.AppendTag(entry, 2, protowire.BytesType), v)
	}
	return protowire.AppendBytes(protowire.AppendTag(b, field, protowire.BytesType), entry)
}

// decodeMD reads the stored form back. Field 3, when there is one, holds
// what an adapter keeps beside them (unary.Metadata.Adapter).
func decodeMD(b []byte) (md seam.Metadata, err error) {
	header, trailer, adapter, err := decodeStoredMD(b)
	return seam.Metadata{Header: header, Trailer: trailer, Adapter: adapter}, err
}

func decodeStoredMD(b []byte) (header, trailer metadata.MD, adapter []byte, err error) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || typ != protowire.BytesType {
			return nil, nil, nil, errors.New("stored metadata is malformed")
		}
		b = b[n:]
		entry, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return nil, nil, nil, errors.New("stored metadata is malformed")
		}
		b = b[n:]
		if num == 3 {
			adapter = entry
			continue
		}
		key, values, err := decodeEntry(entry)
		if err != nil {
			return nil, nil, nil, err
		}
		switch num {
		case 1:
			header = metadata.Join(header, metadata.MD{key: values})
		case 2:
			trailer = metadata.Join(trailer, metadata.MD{key: values})
		}
	}
	return header, trailer, adapter, nil
}

func decodeEntry(b []byte) (key string, values []string, err error) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || typ != protowire.BytesType {
			return "", nil, errors.New("stored metadata entry is malformed")
		}
		b = b[n:]
		v, n := protowire.ConsumeString(b)
		if n < 0 {
			return "", nil, errors.New("stored metadata entry is malformed")
		}
		b = b[n:]
		if num == 1 {
			key = v
		} else {
			values = append(values, v)
		}
	}
	return key, values, nil
}

// SetSendCompressor is [grpc.SetSendCompressor] for handlers behind
// [UnaryServerInterceptor]; call it instead, with the handler's ctx. To
// hold back and store what a handler sets, the interceptor gives a keyed
// call's handler a stream of its own in ctx, and grpc-go's function only
// works with grpc-go's own (internal) stream type, so it fails there with
// "failed to fetch the stream from the given context". This one reaches the
// call's real stream, and works the same on calls the interceptor passed
// through. The compressor applies to this call's response only: it is not
// stored, and a replay is compressed as gRPC chooses by default.
func SetSendCompressor(ctx context.Context, name string) error {
	return grpc.SetSendCompressor(transportContext(ctx), name)
}

// ClientSupportedCompressors is [grpc.ClientSupportedCompressors] for
// handlers behind [UnaryServerInterceptor]; see [SetSendCompressor] for
// why grpc-go's own fails on keyed calls.
func ClientSupportedCompressors(ctx context.Context) ([]string, error) {
	return grpc.ClientSupportedCompressors(transportContext(ctx))
}

// transportContext returns ctx with the call's real stream in place of the
// recorders this package put there.
func transportContext(ctx context.Context) context.Context {
	r, ok := grpc.ServerTransportStreamFromContext(ctx).(*recordingStream)
	if !ok {
		return ctx
	}
	for {
		inner, ok := r.ServerTransportStream.(*recordingStream)
		if !ok {
			return grpc.NewContextWithServerTransportStream(ctx, r.ServerTransportStream)
		}
		r = inner
	}
}
