package faultproxy

import (
	"encoding/binary"
	"io"
)

// clientPreface opens every HTTP/2 connection from the client; the server
// side has no such preface and starts directly with a SETTINGS frame.
const clientPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

const frameHeaderLen = 9

// HTTP/2 frame types (RFC 9113, section 6) that the proxy cares about.
const (
	frameData         uint8 = 0x0
	frameHeaders      uint8 = 0x1
	frameRSTStream    uint8 = 0x3
	frameSettings     uint8 = 0x4
	framePing         uint8 = 0x6
	frameGoAway       uint8 = 0x7
	frameWindowUpdate uint8 = 0x8
	frameContinuation uint8 = 0x9
)

// HTTP/2 frame flags. ACK shares its bit with END_STREAM; which one applies
// depends on the frame type.
const (
	flagEndStream  uint8 = 0x1
	flagAck        uint8 = 0x1
	flagEndHeaders uint8 = 0x4
)

// errCodeCancel is the RST_STREAM error code used to discard replayed
// streams that are not the one being duplicated.
const errCodeCancel uint32 = 0x8

// frame is one HTTP/2 frame as read off the wire. raw holds the header and
// payload exactly as received and is reused by the next read, so anything
// that keeps it must copy it.
type frame struct {
	length uint32
	typ    uint8
	flags  uint8
	stream uint32
	raw    []byte
}

// read reads the next whole frame from r into f.
func (f *frame) read(r io.Reader) error {
	if cap(f.raw) < frameHeaderLen {
		f.raw = make([]byte, frameHeaderLen, bufSize)
	}
	f.raw = f.raw[:frameHeaderLen]
	if _, err := io.ReadFull(r, f.raw); err != nil {
		return err
	}
	h := f.raw
	f.length = uint32(h[0])<<16 | uint32(h[1])<<8 | uint32(h[2])
	f.typ = h[3]
	f.flags = h[4]
	f.stream = binary.BigEndian.Uint32(h[5:9]) & 0x7fffffff
	need := frameHeaderLen + int(f.length)
	if cap(f.raw) < need {
		grown := make([]byte, need)
		copy(grown, f.raw)
		f.raw = grown
	}
	f.raw = f.raw[:need]
	_, err := io.ReadFull(r, f.raw[frameHeaderLen:])
	return err
}

// isResponseStart reports whether f can carry response content. Control
// frames (SETTINGS, PING, WINDOW_UPDATE, ...) and anything on stream 0 are
// connection housekeeping, not responses.
func (f *frame) isResponseStart() bool {
	return f.stream != 0 && (f.typ == frameHeaders || f.typ == frameData)
}

// endsStream reports whether f is the last frame its sender will send on the
// stream.
func (f *frame) endsStream() bool {
	switch f.typ {
	case frameHeaders, frameData:
		return f.flags&flagEndStream != 0
	case frameRSTStream:
		return true
	}
	return false
}

// appendFrame appends a serialized frame to b.
func appendFrame(b []byte, typ, flags uint8, stream uint32, payload []byte) []byte {
	n := len(payload)
	b = append(b, byte(n>>16), byte(n>>8), byte(n), typ, flags)
	b = binary.BigEndian.AppendUint32(b, stream&0x7fffffff)
	return append(b, payload...)
}

func appendRSTStream(b []byte, stream, code uint32) []byte {
	return appendFrame(b, frameRSTStream, 0, stream, binary.BigEndian.AppendUint32(nil, code))
}

func appendWindowUpdate(b []byte, stream, increment uint32) []byte {
	return appendFrame(b, frameWindowUpdate, 0, stream, binary.BigEndian.AppendUint32(nil, increment))
}
